# Batch sizes that fit: find_executable_batch_size halving on out-of-memory, largest_batch_size by estimate.
import pytest
import torch

import shardwise as sw
from shardwise.errors import ArgumentError, EnvError
from shardwise.memory import SAFE_FRACTION
from shardwise.testing import TinyTransformerLM


def allocating(limit):
    """A training function that asks torch's CPU allocator for 4 EiB above ``limit`` samples:
    a real out-of-memory error from the allocator, not one raised by the test."""
    tried = []

    def train(batch_size, scale=1):
        tried.append(batch_size)
        if batch_size > limit:
            torch.empty(2**62, dtype=torch.uint8)
        return batch_size * scale

    return train, tried


def test_find_executable_batch_size_halves_on_out_of_memory_until_it_runs():
    train, tried = allocating(20)
    assert sw.find_executable_batch_size(train, starting_batch_size=128)(scale=2) == 32
    assert tried == [128, 64, 32, 16]
    decorated, tried = allocating(3)
    assert sw.find_executable_batch_size(starting_batch_size=8)(decorated)() == 2
    assert tried == [8, 4, 2]

    never, tried = allocating(0)
    with pytest.raises(RuntimeError, match="no batch size from 4 down to 1") as caught:
        sw.find_executable_batch_size(never, starting_batch_size=4)()
    assert tried == [4, 2, 1] and "allocate" in str(caught.value.__cause__)


def test_find_executable_batch_size_raises_any_other_error_at_once_and_checks_its_arguments():
    calls = []

    def broken(batch_size):
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        sw.find_executable_batch_size(broken, starting_batch_size=64)()
    assert calls == [64]
    with pytest.raises(ArgumentError, match="'starting_batch_size' must be an integer >= 1"):
        sw.find_executable_batch_size(broken, starting_batch_size=0)
    with pytest.raises(ArgumentError, match="called without 'batch_size'"):
        sw.find_executable_batch_size(broken)(batch_size=3)
    with pytest.raises(ArgumentError, match="first parameter"):
        sw.find_executable_batch_size(lambda: None)


def test_a_failed_try_holds_nothing_during_the_next():
    """What a try that ran out of memory allocated is freed before the next try starts (the
    saved error keeps no frame alive); the last error still chains, with its traceback."""
    import weakref

    held, alive = [], []

    def train(batch_size):
        alive.append([ref() is not None for ref in held])
        activations = torch.ones(1024)
        held.append(weakref.ref(activations))
        if batch_size > 1:
            torch.empty(2**62, dtype=torch.uint8)
        raise torch.OutOfMemoryError("out of memory at batch 1")

    with pytest.raises(RuntimeError, match="no batch size from 4 down to 1") as caught:
        sw.find_executable_batch_size(train, starting_batch_size=4)()
    assert alive == [[], [False], [False, False]]
    assert "batch 1" in str(caught.value.__cause__) and caught.value.__cause__.__traceback__


def test_a_batch_size_passed_by_position_is_refused_by_name():
    train, tried = allocating(8)
    decorated = sw.find_executable_batch_size(train, starting_batch_size=4)
    with pytest.raises(ArgumentError, match=r"train\(\) is called without 'batch_size'.*"
                                            r"got 2 positional argument"):
        decorated(64, 2)
    with pytest.raises(ArgumentError, match="called without 'batch_size'"):
        sw.find_executable_batch_size(lambda batch_size: batch_size)(64)
    assert tried == [] and decorated(2) == 8  # scale=2: one argument after the batch size
    assert sw.find_executable_batch_size(lambda batch_size, *rest: len(rest))(1, 2) == 2


def tokens(n):
    return {"input_ids": torch.zeros(n, 32, dtype=torch.long),
            "labels": torch.zeros(n, 32, dtype=torch.long)}


def test_largest_batch_size_is_the_largest_the_estimate_admits():
    model = TinyTransformerLM(vocab=64, dim=32, heads=2, layers=2)
    env = sw.Env(device_memory_bytes=3 * 2**20)
    pipe = [sw.replicate()]
    size = sw.largest_batch_size(model, pipe, tokens, start=64, env=env)
    admitted = [n for n in range(1, 65)
                if sw.estimate_memory(model, pipe, env, batch=tokens(n)).fits]
    assert admitted and size == max(admitted) and admitted == list(range(1, size + 1))
    assert size == 11  # not a power of two: the search goes on between 8 and 16
    with pytest.raises(EnvError, match="even a batch of 1 does not fit"):
        sw.largest_batch_size(model, pipe, tokens, env=sw.Env(device_memory_bytes=2**10))
    with pytest.raises(EnvError, match="memory is unknown"):
        sw.largest_batch_size(model, pipe, tokens, env=sw.Env())
    with pytest.raises(ArgumentError, match="'start' must be an integer >= 1"):
        sw.largest_batch_size(model, pipe, tokens, start=0, env=env)


class Reads(torch.nn.Module):
    """A forward that reads a tensor's value, as some Transformers models do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)[: int(x.sum().item()) + 1].sum()


def test_an_estimate_says_why_it_has_no_activations_and_what_it_cannot_tell():
    env = sw.Env(device_memory_bytes=2**30)
    estimate = sw.estimate_memory(Reads(), [], env, batch=torch.ones(2, 4))
    assert estimate.activations_bytes is None and estimate.fits is None
    assert "cannot run on the meta device" in estimate.activations_missing
    assert ".item()" in estimate.activations_missing and "cannot tell" in str(estimate)
    plain = sw.estimate_memory(TinyTransformerLM(vocab=64, dim=32, heads=2, layers=2), [], env)
    assert plain.activations_missing.startswith("no sample batch") and plain.fits is None
    measured = sw.estimate_memory(TinyTransformerLM(vocab=64, dim=32, heads=2, layers=2), [], env,
                                  batch=tokens(2))
    assert measured.fits is True and measured.budget_bytes == int(2**30 * SAFE_FRACTION)


def test_context_parallel_divides_the_activations_by_its_size_and_says_so():
    """Each rank of a context-parallel group holds a slice of every sequence: the estimate's
    activations are the whole batch's over the group's size, said in its layout; parameters,
    gradients and optimizer state are those of the distribution beside it."""
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long)}
    env = sw.Env(world_size=4, local_world_size=4)
    alone = sw.estimate_memory(model, [sw.shard()], env, batch=batch)
    split = sw.estimate_memory(model, [sw.context_parallel(size=2), sw.shard()], env, batch=batch)
    assert split.activations_bytes == -(-alone.activations_bytes // 2)
    assert (split.params_bytes, split.grads_bytes, split.optimizer_bytes) == (
        alone.params_bytes, alone.grads_bytes, alone.optimizer_bytes)
    assert "context parallel over 2 (activations of the whole batch / 2)" in split.layout


def test_attention_is_estimated_as_a_fused_kernel_saves_it():
    """SDPA on the meta device would dispatch to the math kernel, which saves the S x S
    weights; the estimate counts what a fused kernel saves (query, key, value, output, one
    statistic per row), so a long sequence's activations grow linearly."""

    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    sizes = [sw.estimate_memory(Attend(), [], batch=torch.zeros(1, n, 16)).activations_bytes
             for n in (1024, 2048)]
    weights = 2 * 1024 * 1024 * 4  # what the math kernel would save at 1024 tokens
    assert sizes[0] < weights / 16
    assert sizes[1] == pytest.approx(2 * sizes[0], rel=0.01)
