# sw.save(blocking=False) in one process: as a blocking save; its arguments; a failed write publishes nothing.
import pytest
import torch

import shardwise as sw
from shardwise.errors import CheckpointError
from shardwise.testing import full_state

from conftest import build_lm

STEPS = 6


def batches_of(bundle):
    while True:
        yield from bundle.loader


def train(path, parts, blocking):
    """6 optimizer steps; saves at steps 2 and 4 (keep_last=1). Returns the weights as they
    were when each save was asked for, and at the end."""
    bundle = build_lm(parts)
    state, asked, handles = bundle.init(), {}, []
    batches = batches_of(bundle)
    while state.step < STEPS:
        state, out = bundle.step(state, next(batches))
        if out.stepped and state.step in (2, 4):
            state = bundle.check(state)
            asked[state.step] = full_state(bundle.model)
            handles.append(sw.save(path, bundle, state, keep_last=1, blocking=blocking))
    state = bundle.check(state)
    first_done_when_second_returned = handles[0].done() if not blocking else True
    published = [h.result() if not blocking else h for h in handles]
    return {"asked": asked, "end": full_state(bundle.model), "published": [p.name for p in published],
            "first_done": first_done_when_second_returned,
            "handle": repr(handles[-1]) if not blocking else ""}


def resume(path, parts):
    bundle = build_lm(parts)
    state = sw.load(path, bundle)
    loaded = full_state(bundle.model)
    batches = batches_of(bundle)
    while state.step < STEPS:
        state, _ = bundle.step(state, next(batches))
    bundle.check(state)
    return {"step_loaded": sw.latest_checkpoint(path).name, "loaded": loaded,
            "end": full_state(bundle.model)}


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_process_async_equals_blocking(tmp_path):
    background = train(str(tmp_path / "a"), [], blocking=False)
    blocking = train(str(tmp_path / "b"), [], blocking=True)
    assert equal(background["end"], blocking["end"])
    for name in ("a", "b"):
        assert resume(str(tmp_path / name), [])["step_loaded"] == "step_00000004"
    assert equal(resume(str(tmp_path / "a"), [])["loaded"], blocking["asked"][4])


def test_a_failed_background_write_publishes_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = tmp_path / "ckpt"
    bundle = build_lm([])
    state, batches = bundle.init(), batches_of(bundle)
    while state.step < 2:
        state, _ = bundle.step(state, next(batches))
    sw.save(path, bundle, state)  # a good one first
    while state.step < 4:
        state, _ = bundle.step(state, next(batches))

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    handle = sw.save(path, bundle, state, blocking=False)
    with pytest.raises(CheckpointError, match=r"no space left on device.*still names the previous"):
        handle.result()
    assert sw.latest_checkpoint(path).name == "step_00000002"
    assert not list(path.glob(".tmp.*"))  # the unpublished files are removed
    assert "failed" in repr(handle)


def test_arguments_are_checked():
    bundle = build_lm([])
    with pytest.raises(sw.errors.ArgumentError, match="'blocking' must be True or False"):
        sw.save("x", bundle, bundle.init(), blocking="no")
    with pytest.raises(sw.errors.ArgumentError, match="'async_checkpoints' must be True or False"):
        sw.fit(bundle, steps=1, async_checkpoints=1)
