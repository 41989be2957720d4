# Checkpoint edges a hostile review found, in one process: each was a lost, mixed or half-restored state.
import errno

import pytest
import torch
from torch.optim import lr_scheduler

import shardwise as sw
from shardwise.checkpoint import lock, transaction
from shardwise.errors import CheckpointError

from conftest import build_lm, fingerprint, lm_bundle, same, train_for


def test_ctrl_c_while_a_save_clears_debris_never_leaves_the_root_locked(tmp_path, monkeypatch):
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)

    def interrupted(root, names="*"):
        raise KeyboardInterrupt

    monkeypatch.setattr("shardwise.checkpoint.transaction.recover", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sw.save(tmp_path, bundle, state)
    monkeypatch.undo()
    lock.acquire(tmp_path, wait=0.1).release()  # free at once, in this process too
    assert sw.save(tmp_path, bundle, state).name == "step_00000001"


def test_a_scheduler_of_the_same_class_built_otherwise_is_refused_and_changes_nothing(tmp_path):
    def sequential(opt, count):
        parts = [lr_scheduler.StepLR(opt, step_size=2) for _ in range(count)]
        return lr_scheduler.SequentialLR(opt, parts, milestones=list(range(2, 2 * count, 2)))

    saved = lm_bundle(scheduler=None)
    saved = sw.pipeline(sw.detect())(saved.model, saved.optimizer, saved.loader.loader,
                                     scheduler=sequential(saved.optimizer, 3))
    state, _ = train_for(saved, saved.init(), 3)
    sw.save(tmp_path, saved, state)
    other = lm_bundle(scheduler=None)
    other = sw.pipeline(sw.detect())(other.model, other.optimizer, other.loader.loader,
                                     scheduler=sequential(other.optimizer, 2))
    before = fingerprint(other)
    with pytest.raises(CheckpointError, match=r"scheduler: the checkpoint's SequentialLR state "
                                              r"does not load into this one \(IndexError"):
        sw.load(tmp_path, other)
    assert same(before, fingerprint(other))
    assert all(set(vars(a)) == set(vars(b)) for a, b in zip(
        other.scheduler._schedulers, sequential(torch.optim.SGD([torch.zeros(1)], lr=1), 2)
        ._schedulers, strict=True))


def test_a_shuffle_changed_mid_epoch_is_refused(tmp_path):
    bundle = lm_bundle()
    state, _ = train_for(bundle, bundle.init(), 3)
    sw.save(tmp_path, bundle, state)
    other = lm_bundle(shuffle=False)
    before = fingerprint(other)
    with pytest.raises(CheckpointError, match="read with shuffle=True, this loader has "
                                              "shuffle=False"):
        sw.load(tmp_path, other)
    assert same(before, fingerprint(other))


def test_a_failure_after_the_rename_says_the_checkpoint_was_published(tmp_path, monkeypatch):
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    first = sw.save(tmp_path, bundle, state)
    real = transaction.write_durably

    def full(path, text):
        if path.name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, text)

    monkeypatch.setattr(transaction, "write_durably", full)
    state, _ = train_for(bundle, state, 1)
    with pytest.raises(CheckpointError, match=r"step_00000002 was published \(it loads by its "
                                              r"path\), but pointing latest at it \(latest still "
                                              r"names the checkpoint before\) failed: No space"):
        sw.save(tmp_path, bundle, state)
    monkeypatch.undo()
    assert sw.load(tmp_path / "step_00000002", bundle).step == 2
    assert sw.latest_checkpoint(tmp_path) == first  # as the message says


def test_a_save_right_after_loading_an_epoch_start_records_the_epoch_start(tmp_path):
    bundle = build_lm([], accumulate=1)
    start = sw.save(tmp_path / "start", bundle, bundle.init())
    state, _ = train_for(bundle, bundle.init(), 2)
    sw.save(tmp_path / "mid", bundle, state)
    again = build_lm([], accumulate=1, batch_size=2)
    state = sw.load(tmp_path / "mid", again)  # resumed elsewhere in the epoch: another base
    state, _ = train_for(again, state, 1)
    state = sw.load(start, again)
    path = sw.save(tmp_path / "again", again, state)
    import json
    assert json.loads((path / "shardwise.json").read_text())["data"]["cursor"] == 0


def test_multistep_milestones_survive_a_checkpoint(tmp_path):
    def run(resume_at=None):
        bundle = lm_bundle(scheduler=None)
        scheduler = lr_scheduler.MultiStepLR(bundle.optimizer, milestones=[4, 6], gamma=0.1)
        bundle = sw.pipeline(sw.detect())(bundle.model, bundle.optimizer, bundle.loader.loader,
                                          scheduler=scheduler)
        state, lrs = bundle.init(), []
        if resume_at is not None:
            state = sw.load(tmp_path, bundle)
        while state.step < 8:
            state, _ = train_for(bundle, state, 1)
            lrs.append(scheduler.get_last_lr()[0])
            if state.step == 3 and resume_at is None:
                sw.save(tmp_path, bundle, state)
        return lrs

    whole = run()
    assert run(resume_at=3) == whole[3:]


def test_a_symlink_named_like_a_moved_aside_checkpoint_is_left_and_named(tmp_path):
    """Only what shardwise wrote is swept: a re-save whose set-aside name is taken by a
    user's symlink is refused naming it; the link, its target and step 1 stay."""
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path, bundle, state)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".old.step_00000001").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"\.old\.step_00000001 is in the way"):
        sw.save(tmp_path, bundle, state)  # a re-save of step 1
    assert (tmp_path / ".old.step_00000001").is_symlink()
    assert (tmp_path / "elsewhere").is_dir() and sw.load(tmp_path, bundle).step == 1


def test_the_sweep_removes_only_what_shardwise_wrote(tmp_path):
    """A save clears an interrupted save's .tmp.step_N and a half-deleted .trash.*, and
    leaves the user's own hidden entries, whatever their prefix."""
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path, bundle, state)
    mine = {".tmp.notes": "file", ".old.config": "file", ".old.data": "dir", "data": "dir",
            ".tmp.scratch": "dir", ".trash.old": "dir", ".tmp.cache": "dir", ".tmp.rngs": "dir"}
    for name, kind in mine.items():
        if kind == "file":
            (tmp_path / name).write_text("keep me")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "notes.txt").write_text("keep me")
    (tmp_path / ".tmp.cache" / "cache").mkdir()  # named like the Trainer's staged folder
    (tmp_path / ".tmp.rngs" / "rng").mkdir()  # named like the RNG folder, holding notes
    (tmp_path / ".tmp.rngs" / "rng" / "notes.txt").write_text("keep me")
    debris = tmp_path / ".tmp.step_00000007"  # killed mid-write
    (debris / "rng").mkdir(parents=True)
    (debris / "rng" / "rank_00000.json").write_text("{}")
    (debris / "__0_0.distcp").write_bytes(b"x")
    deepspeed = tmp_path / ".tmp.step_00000008"  # DeepSpeed's files and its scripts
    (deepspeed / "deepspeed").mkdir(parents=True)
    (deepspeed / "zero_to_fp32.py").write_text("# DeepSpeed's")
    trash = tmp_path / ".trash.step_00000001.0123abcd"  # killed mid-delete
    trash.mkdir()
    (trash / transaction.TRASH_MARK).touch()
    (trash / ".metadata").write_bytes(b"x")
    state, _ = train_for(bundle, state, 1)
    sw.save(tmp_path, bundle, state)
    assert not debris.exists() and not trash.exists() and not deepspeed.exists()
    assert (tmp_path / ".tmp.cache" / "cache").is_dir()
    for name, kind in mine.items():
        path = tmp_path / name if kind == "file" else tmp_path / name / "notes.txt"
        assert path.read_text() == "keep me", name


@pytest.mark.parametrize("planted", ["folder", "file", "symlink", "step folder"])
def test_a_save_never_replaces_what_shardwise_did_not_write(tmp_path, planted):
    """A user's folder, file or symlink where a named or step checkpoint would go is
    refused, naming it, and kept; a named checkpoint of shardwise's is replaced."""
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    name = "step_00000001" if planted == "step folder" else "final"
    target = tmp_path / name
    if planted in ("folder", "step folder"):
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    elif planted == "file":
        target.write_text("keep me")
    else:
        (tmp_path / "export").mkdir()
        target.symlink_to(tmp_path / "export")
    with pytest.raises(CheckpointError, match="not a checkpoint shardwise saved under this name"):
        sw.save(tmp_path, bundle, state, name=None if planted == "step folder" else name)
    kept = {"folder": target / "notes.txt", "step folder": target / "notes.txt",
            "file": target, "symlink": tmp_path / "export"}[planted]
    assert kept.exists() and (planted == "symlink" or kept.read_text() == "keep me")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]
    sw.save(tmp_path, bundle, state, name="again")
    sw.save(tmp_path, bundle, state, name="again")  # its own: replaced
    assert sw.load(tmp_path, bundle, name="again").step == 1


def test_a_named_checkpoint_that_is_a_symlink_is_never_followed(tmp_path):
    other = build_lm([], accumulate=1)
    state, _ = train_for(other, other.init(), 2)
    published = sw.save(tmp_path / "other_run", other, state)
    bundle = build_lm([], accumulate=1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best").symlink_to(published)
    before = fingerprint(bundle)
    with pytest.raises(CheckpointError, match="is a symlink"):
        sw.load(tmp_path / "run", bundle, name="best")
    assert same(before, fingerprint(bundle))


@pytest.mark.parametrize("name", ["latest.tmp", "latest.old", "latest"])
def test_names_of_the_latest_marker_are_refused(tmp_path, name):
    bundle = build_lm([], accumulate=1)
    with pytest.raises(sw.errors.ArgumentError, match="'latest'"):
        sw.save(tmp_path, bundle, sw.TrainState(), name=name)
    assert not list(tmp_path.iterdir())


def test_latest_is_followed_past_step_99999999(tmp_path):
    bundle = build_lm([], accumulate=1)
    sw.save(tmp_path, bundle, sw.TrainState(step=100_000_005, micro_step=100_000_005))
    sw.save(tmp_path, bundle, sw.TrainState(step=100_000_001, micro_step=100_000_001))
    assert sw.load(tmp_path, bundle).step == 100_000_001  # latest: the rollback


def test_a_refused_load_runs_no_optimizer_step_hook(tmp_path):
    bundle = lm_bundle(scheduler=None)
    state, _ = train_for(bundle, bundle.init(), 2)
    sw.save(tmp_path, bundle, state)
    fresh = lm_bundle()  # a scheduler the checkpoint lacks; a fresh optimizer
    calls = []
    fresh.optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    with pytest.raises(CheckpointError):
        sw.load(tmp_path, fresh)
    assert calls == [] and not fresh.optimizer.state


def test_a_mid_epoch_resume_is_exact_with_accelerates_split_and_global_seed(tmp_path):
    """distribute_data(split="batches", global_seed=True) (Accelerate's data settings): the
    resumed epoch's iteration draws no second seed from torch's generator, so dropout after
    a mid-epoch resume is the uninterrupted run's (it was 2.1e-3 off)."""
    def run(resume):
        bundle = build_lm([sw.distribute_data(split="batches", global_seed=True)], accumulate=1)
        torch.manual_seed(5)
        state = sw.load(tmp_path, bundle) if resume else bundle.init()
        for batch in bundle.loader:
            state, _ = bundle.step(state, batch)
            if state.step == 3 and not resume:
                sw.save(tmp_path, bundle, state)
            if state.step == 7:
                break
        return {k: v.clone() for k, v in bundle.model.state_dict().items()}

    whole = run(resume=False)
    resumed = run(resume=True)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
