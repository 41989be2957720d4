# sw.save(blocking=False) in one process: as a blocking save; its arguments; a failed write publishes nothing.
import pytest

import shardwise as sw
from shardwise.errors import CheckpointError

from _background_save import batches_of, resume, train
from _checkpointing import equal
from conftest import build_lm


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
