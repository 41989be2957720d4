# The default step reads nothing on the host it has just computed; a late check still names the step.
# Its tests that start no process are in tests/unit/test_host_reads.py.

import pytest
import torch

import shardwise as sw
from shardwise.errors import NonFiniteError
from shardwise.testing import full_state, max_param_diff, run_distributed

from conftest import lm_and_adamw, nan_loss, reads_per_call, token_batches


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
