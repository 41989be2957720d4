# Fixtures and helpers shared by the test modules (importable from spawned ranks: `conftest`).
import contextlib
import copy
import os
import random
import signal
from typing import NamedTuple

import numpy as np
import pytest
import torch
from _tiers import marks_of  # tests/ is on the path (pytest's rootdir)
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM

#: one process on the CPU, whatever this machine has
ONE = sw.Env()


def token_loss(model, batch):
    """Sum of cross-entropy over labelled tokens (computed in fp32), and their count."""
    logits = model(batch["input_ids"])["logits"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                             ignore_index=-100, reduction="sum")
    return loss, (batch["labels"] != -100).sum()


class Prompts(torch.utils.data.Dataset):
    """Token ids whose labels mask a prompt of 1..``prompt``-1 tokens and right padding of
    0..``pad``-1 tokens (mask 0, label -100): token counts differ per sample, per batch and
    per slice or microbatch."""

    def __init__(self, size=48, seq=16, vocab=64, prompt=8, pad=6):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (size, seq), generator=gen)
        self.labels = self.ids.clone()
        self.mask = torch.ones_like(self.ids)
        for i in range(size):
            masked = int(torch.randint(1, prompt, (), generator=gen))
            padded = int(torch.randint(0, pad, (), generator=gen))
            self.labels[i, :masked] = -100
            if padded:
                self.ids[i, -padded:] = 0
                self.labels[i, -padded:] = -100
                self.mask[i, -padded:] = 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "attention_mask": self.mask[i]}


def llama(layers=4, tied=False):
    """A tiny Transformers Llama (random init, offline): 64 tokens, hidden 32, 4 heads over
    2 key-value heads, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, attn_implementation="sdpa",
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def masked_micro_batches(count=3, size=2, seq=10, vocab=32, seed=0):
    """``count`` token micro-batches whose labels are masked unevenly (different item counts)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count * size, seq), generator=gen)
    labels = ids.roll(-1, 1).clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.5] = -100
    return [{"input_ids": ids[i:i + size], "labels": labels[i:i + size]}
            for i in range(0, count * size, size)]


def build_lm(parts, batch_size=4, accumulate=2):
    """A tiny LM with dropout, AdamW, a StepLR schedule and a shuffled, drop_last loader of 48
    samples (6 batches an epoch on 2 ranks), under ``parts`` and ``accumulate_gradients``."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(SyntheticTokens(size=48, seq_len=8), batch_size=batch_size, shuffle=True,
                        drop_last=True)
    pipe = sw.pipeline(sw.detect(), *parts, sw.accumulate_gradients(accumulate))
    return pipe(model, opt, loader, scheduler=sched)


def train_for(bundle, state, micro_steps):
    """Train ``micro_steps`` micro-batches from ``bundle.loader``, epoch after epoch; the
    final state and each micro-batch's loss."""
    losses = []
    while micro_steps:
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            losses.append(out.loss.item())
            micro_steps -= 1
            if micro_steps == 0:
                break
    return state, losses


def train_steps(bundle, state, batches):
    """Step ``bundle`` over ``batches`` from ``state``; the final state and every output."""
    outputs = []
    for batch in batches:
        state, out = bundle.step(state, batch)
        outputs.append(out)
    return state, outputs


@pytest.fixture
def one():
    """The one-process CPU env."""
    return ONE


class Hang(BaseException):
    """Raised by :func:`within`'s alarm: not an Exception, so no handler under test swallows it."""


@contextlib.contextmanager
def within(seconds=60):
    """Fail, instead of hanging, a block that runs longer than ``seconds`` (main thread only)."""
    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# Property-based tests: a few hundred examples in CI; `HYPOTHESIS_PROFILE=long pytest -m long`
# (see docs/reliability.md) runs thousands.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("long", max_examples=2000, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a dev dependency; only the property tests need it
    pass


def run_property(check, *, long=False):
    """Run ``check(data)`` as a hypothesis property: the loaded profile, or the long one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    chosen = settings(settings.get_profile("long"), database=None) if long else \
        settings(database=None)
    chosen(given(st.data())(check))()


# -- what a checkpoint load may change, and a bundle to load into (checkpoint tests) --------

def fingerprint(bundle):
    """Everything a load may change, as copies: model, optimizer, scheduler, generators,
    the loader's position, gradients."""
    optimizer = bundle.optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in bundle.model.state_dict().items()},
        "optimizer": {(i, n): t.clone() for i, s in optimizer["state"].items()
                      for n, t in s.items() if isinstance(t, torch.Tensor)},
        "groups": copy.deepcopy(optimizer["param_groups"]),
        "scheduler": copy.deepcopy(bundle.scheduler.state_dict()) if bundle.scheduler else None,
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
        "loader": (bundle.loader._next_epoch, bundle.loader._resume_at,
                   bundle.loader._resume_cursor) if bundle.loader is not None else None,
        "grads": [None if p.grad is None else p.grad.clone() for p in bundle.model.parameters()],
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


def lm_bundle(optimizer="adamw", scheduler="step", groups=1, seed=0, size=48, sampler=None,
              shuffle=True):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2, dropout=0.1)
    params = list(model.parameters())
    param_groups = [{"params": params}] if groups == 1 else [
        {"params": params[:3]}, {"params": params[3:], "lr": 1e-3}]
    opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optimizer](param_groups, lr=3e-3)
    sched = {"step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=3),
             "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
             None: lambda: None}[scheduler]()
    data = sw.testing.SyntheticTokens(size=size, seq_len=8)
    loader = DataLoader(data, batch_size=4, shuffle=shuffle and sampler is None, drop_last=True,
                        sampler=sampler(data) if sampler else None)
    return sw.pipeline(sw.detect(), sw.distribute_data(seed=seed))(model, opt, loader,
                                                                  scheduler=sched)


# -- a tiny LM, its token batches, its host reads counted (the host-sync tests, CPU and GPU) --

def token_batches(n, seed=0):
    """``n`` batches of 4 token sequences (vocabulary 64)."""
    data = SyntheticTokens(size=4 * n, seq_len=8, vocab=64, seed=seed)
    return list(DataLoader(data, batch_size=4))


def lm_and_adamw():
    """A tiny LM (vocabulary 64) and its AdamW, seeded."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=16, heads=2, layers=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


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


# -- an Accelerate FSDP config file (the from_config tests, one process and ranks) ----------

SEED = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_cpu_offload": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    "mixed_precision": "bf16", "num_machines": 1, "num_processes": 4}


# -- the sw.compile tests' eager runs (tests/_compiling.py) ----------------------------------

@pytest.fixture(scope="module")
def eager():
    """:func:`_compiling.train` without ``sw.compile``, at batch sizes 2 and 4 (once a module)."""
    from _compiling import train

    return {size: train([], batch_size=size) for size in (2, 4)}


# -- the lifecycle matrix: each layout shardwise offers, one line -----------------------------
# tests/distributed/test_lifecycle.py runs every row on real ranks; tests/unit/
# test_lifecycle_matrix.py fails when a transform that distributes a model is in no row.

DEEPSPEED = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
             "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "steps_per_print": 10**9}


class Layout(NamedTuple):
    ranks: int
    parts: tuple
    data_ranks: int = 1  # ranks reading different batches (each reads GLOBAL_BATCH / this)
    nodes: int = 1  # ranks posing as this many nodes (HSDP)
    #: one process computes what this layout computes (local SGD's replicas do not)
    equals_one_process: bool = True
    #: the model's own mean loss (DeepSpeed divides by its accumulation steps itself)
    mean_loss: bool = False
    #: the model it trains: "llama", or "moe" (tests/_moe.py's Qwen3-MoE)
    model: str = "llama"
    #: a torchft lighthouse runs beside it (fault_tolerant: one replica group of these ranks)
    lighthouse: bool = False


LAYOUTS = {
    "replicate": Layout(2, (sw.replicate(),), data_ranks=2),
    "shard": Layout(2, (sw.shard(),), data_ranks=2),
    "hsdp": Layout(4, (sw.shard(replicate_across_nodes=True),), data_ranks=4, nodes=2),
    "shard_optimizer": Layout(2, (sw.replicate(), sw.shard_optimizer()), data_ranks=2),
    "tensor_parallel": Layout(2, (sw.tensor_parallel(),)),
    "context_parallel": Layout(2, (sw.context_parallel(),)),
    "pp_1f1b": Layout(2, (sw.pipeline_parallel(schedule="1F1B"),)),
    "pp_interleaved": Layout(2, (sw.pipeline_parallel(schedule="Interleaved1F1B"),)),
    "pp_x_tp": Layout(4, (sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2))),
    "pp_x_dp_shard": Layout(4, (sw.pipeline_parallel(size=2), sw.shard()), data_ranks=2),
    "cp_x_tp": Layout(4, (sw.context_parallel(size=2), sw.tensor_parallel(size=2))),
    "expert_parallel": Layout(2, (sw.expert_parallel(),), data_ranks=2, model="moe"),
    "local_sgd": Layout(2, (sw.replicate(), sw.local_sgd(2)), data_ranks=2,
                        equals_one_process=False),
    "deepspeed": Layout(2, (sw.deepspeed(DEEPSPEED),), data_ranks=2, mean_loss=True),
    "fault_tolerant": Layout(2, (sw.shard(), sw.fault_tolerant(group=0, groups=1,
                                                               hostname="127.0.0.1")),
                             data_ranks=2, lighthouse=True),
}


def pytest_collection_modifyitems(config, items):
    """Mark each test by what it starts (``tests/_tiers.py``): ``processes`` and
    ``many_ranks``; ``make test-fast`` deselects the first."""
    from pathlib import Path

    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        for mark in marks_of(Path(str(item.fspath)), function.__name__,
                             list(getattr(item, "fixturenames", ()))):
            item.add_marker(getattr(pytest.mark, mark))
