# The default step reads nothing on the host it has just computed; a late check still names the step.
# Its tests that start no process are in tests/unit/test_host_reads.py.
import contextlib

import pytest
import torch

import shardwise as sw
from shardwise.errors import NonFiniteError
from shardwise.testing import full_state, max_param_diff, run_distributed

from conftest import lm_and_adamw, token_batches

#: every way a tensor's value reaches Python: on an accelerator each waits for the device
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def counting_reads():
    """Record (how, tensor) for every host read of a tensor's value inside."""
    seen: list[tuple[str, torch.Tensor]] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def recording(name, read):
        def reader(self, *args, **kwargs):
            seen.append((name, self))
            return read(self, *args, **kwargs)
        return reader

    for name in READS:
        setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
    try:
        yield seen
    finally:
        for name, own in saved.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)


def reads_per_call(bundle, batches, **step_kwargs):
    """For each step() call: (optimizer stepped, reads of the previous step's pending flag,
    other reads)."""
    state, calls = bundle.init(), []
    for batch in batches:
        pending = state.pending_check
        with counting_reads() as seen:
            state, out = bundle.step(state, batch, **step_kwargs)
        late = sum(1 for _, t in seen if pending is not None and t is pending.flag)
        calls.append((out.stepped, late, len(seen) - late))
    return calls, bundle.check(state)


def nan_loss(model, batch):
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"])["loss"]
    return loss * batch["scale"]


def ranks_reads(parts):
    """On each rank: reads per call of the default step under ``parts``, and the same run
    with a NaN loss on rank 1 alone at step 2 (what raised, weights untouched)."""
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(sw.detect(), *parts)(model, opt)
    calls, _ = reads_per_call(bundle, token_batches(4, seed=bundle.env.rank))
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(sw.detect(), *parts)(model, opt, loss_fn=nan_loss)
    rank = bundle.env.rank
    batches = [{**b, "scale": torch.tensor(float("nan") if i == 1 and rank == 1 else 1.0)}
               for i, b in enumerate(token_batches(3, seed=rank))]
    state, _ = bundle.step(bundle.init(), batches[0])
    weights = full_state(bundle.model)
    state, _ = bundle.step(state, batches[1])
    try:
        bundle.step(state, batches[2])
        raised = ""
    except NonFiniteError as exc:
        raised = str(exc)
    return calls, raised, max_param_diff(full_state(bundle.model), weights)


@pytest.mark.parametrize("parts", [[sw.replicate()], [sw.shard(sw.by_class("TinyDecoderBlock"))]],
                         ids=["replicate", "shard"])
def test_two_ranks_read_nothing_they_just_computed_and_agree_on_a_late_raise(parts):
    for calls, raised, moved in run_distributed(ranks_reads, parts, world_size=2):
        assert [c[2] for c in calls] == [0, 0, 0, 0]
        assert [c[1] for c in calls] == [0, 1, 1, 1]
        assert "optimizer step 2 (micro-step 2)" in raised and "seen at micro-step 3" in raised
        assert moved == 0.0
