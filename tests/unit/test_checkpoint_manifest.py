# Checkpoints as transactions in one process: two bundles and one root's lock, the manifest, forged metadata,
# symlinks, named checkpoints.
import builtins
import io
import json
import os
import pickle
import shutil

import pytest

import shardwise as sw
from shardwise.checkpoint import integrity, lock
from shardwise.errors import ArgumentError, CheckpointError

from _checkpointing import saved_two
from conftest import build_lm, fingerprint, same, train_for

# -- one writer per root ------------------------------------------------------------------

def test_two_bundles_of_one_process_take_turns(tmp_path):
    root = tmp_path / "root"
    first = lock.acquire(root)
    with pytest.raises(CheckpointError, match=rf"pid {os.getpid()} .*this process"):
        lock.acquire(root, wait=0.2)
    first.release()
    lock.acquire(root, wait=0.2).release()
    a, b = build_lm([], accumulate=1), build_lm([], accumulate=1)
    state_a, _ = train_for(a, a.init(), 1)
    state_b, _ = train_for(b, b.init(), 2)
    handle = sw.save(root, a, state_a, blocking=False)
    path_b = sw.save(root, b, state_b)  # waits for a's save in flight, then writes
    assert handle.result().name == "step_00000001" and path_b.name == "step_00000002"
    assert sw.load(handle.result(), b).step == 1 and sw.load(root, a).step == 2


# -- the manifest, forged metadata, symlinks -----------------------------------------------

def test_a_shard_lost_before_hashing_fails_the_save_and_keep_last_deletes_nothing(
        tmp_path, monkeypatch):
    bundle, state, first, second = saved_two(tmp_path)
    digests_of = integrity.digests_of

    def lose_a_shard(root, rank, own=None):
        for shard in root.glob("__0_*.distcp"):
            shard.unlink()
        return digests_of(root, rank, own)

    monkeypatch.setattr(integrity, "digests_of", lose_a_shard)
    state, _ = train_for(bundle, state, 1)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is needed by the checkpoint but "
                                              r"was not written.*still names the previous"):
        sw.save(tmp_path, bundle, state, keep_last=1)
    assert sw.latest_checkpoint(tmp_path) == second and first.is_dir()


def forge_storage_path(checkpoint, new_name):
    """Point every storage entry of .metadata at ``new_name`` and reseal, as a forger would."""
    meta_path = checkpoint / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = new_name
    meta_path.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((checkpoint / integrity.MANIFEST).read_text())
    manifest["files"][".metadata"] = integrity._digest(meta_path)
    manifest["sealed"] = integrity.sealed(manifest["files"])
    (checkpoint / integrity.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("target", ["../../other/step_00000001/__0_0.distcp", "/dev/zero",
                                    "fifo", "sub/__0_0.distcp"])
def test_forged_storage_paths_are_refused_before_dcp_opens_a_file(tmp_path, target):
    bundle, state, first, second = saved_two(tmp_path / "ckpt")
    shutil.copytree(first, tmp_path / "other" / "step_00000001")
    if target == "fifo":
        os.mkfifo(second / "fifo")
    forge_storage_path(second, target)
    before = fingerprint(bundle)
    opened = []
    real_open = io.open

    def watch(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    builtins.open, io.open = watch, watch
    try:
        with pytest.raises(CheckpointError, match="not a plain file name|names 'fifo', which"):
            sw.load(second, bundle)
    finally:
        builtins.open, io.open = real_open, real_open
    assert not any("other" in name or "fifo" in name or name == "/dev/zero" for name in opened)
    assert same(before, fingerprint(bundle))
    assert sw.load(tmp_path / "ckpt", bundle).step == 1  # the root falls back past it


def test_a_symlinked_file_or_step_directory_is_never_followed(tmp_path):
    bundle, state, first, second = saved_two(tmp_path / "ckpt")
    (second / "__0_0.distcp").rename(tmp_path / "moved.distcp")
    (second / "__0_0.distcp").symlink_to(tmp_path / "moved.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp is, or lies under, a symbolic link"):
        sw.load(second, bundle)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step_00000009").symlink_to(second.resolve(), target_is_directory=True)
    (elsewhere / "latest").write_text("step_00000009\n")
    assert sw.latest_checkpoint(elsewhere) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        sw.load(elsewhere, bundle)


# -- named checkpoints ----------------------------------------------------------------------

def test_a_named_checkpoint_sits_beside_the_steps_never_pruned_and_loads_by_name(tmp_path):
    """save(name="best") publishes root/best as a transaction: keep_last never prunes it,
    `latest` never names it, a re-save replaces it (a crash between the two renames leaves
    the old copy loadable by name), and load(name="best") restores exactly what was saved."""
    bundle = build_lm([], accumulate=1)
    state = bundle.init()
    best = None
    for step in range(1, 6):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state, keep_last=2)
        if step == 2:
            assert sw.save(tmp_path, bundle, state, name="best") == tmp_path / "best"
            best = {k: v for k, v in fingerprint(bundle).items()
                    if k in ("model", "optimizer", "groups", "scheduler")}
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["best", "latest", "step_00000004", "step_00000005"]
    assert sw.latest_checkpoint(tmp_path).name == "step_00000005"

    fresh = build_lm([], accumulate=1)
    assert sw.load(tmp_path, fresh, name="best").step == 2
    assert same({k: fingerprint(fresh)[k] for k in best}, best)
    assert sw.load(tmp_path, fresh).step == 5  # without a name: the newest step

    # a re-save of the name, killed between its two renames: the old copy is still "best"
    os.rename(tmp_path / "best", tmp_path / ".old.best")
    assert sw.load(tmp_path, fresh, name="best").step == 2
    sw.save(tmp_path, bundle, state, name="best")  # recovers, then replaces it
    assert not (tmp_path / ".old.best").exists()
    assert sw.load(tmp_path, fresh, name="best").step == 5

    # in the background too: published under its name, `latest` untouched
    assert sw.save(tmp_path, bundle, state, name="last-good", blocking=False).result() \
        == tmp_path / "last-good"
    assert sw.load(tmp_path, fresh, name="last-good").step == 5
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"

    for bad in ("latest", "step_00000002", "../x", ".hidden", "", 3):
        with pytest.raises(ArgumentError, match="'name' must be"):
            sw.save(tmp_path, bundle, state, name=bad)
    with pytest.raises(ArgumentError, match="keep_last prunes step checkpoints"):
        sw.save(tmp_path, bundle, state, name="best", keep_last=2)
    with pytest.raises(CheckpointError, match="no checkpoint named 'worst'"):
        sw.load(tmp_path, fresh, name="worst")
