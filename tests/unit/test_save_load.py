# save / load in one process: exact round trips, keep_last, and damaged, partial or forged checkpoints named.
import json
import os
import pickle
import re

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import CheckpointError
from shardwise.testing import SyntheticTokens, TinyMLP, TinyTransformerLM, full_state

from _checkpointing import Payload, _optimizer_tensors
from conftest import build_lm as build
from conftest import train_for, within


def test_round_trip_in_the_same_process_restores_everything(tmp_path):
    bundle = build([])
    state, _ = train_for(bundle, bundle.init(), 6)
    snapshot = {k: v.clone() for k, v in bundle.model.state_dict().items()}
    opt_snapshot = {k: {n: t.clone() for n, t in s.items()}
                    for k, s in bundle.optimizer.state_dict()["state"].items()}
    lr, rng = bundle.optimizer.param_groups[0]["lr"], torch.get_rng_state()
    sw.save(tmp_path, bundle, state)
    train_for(bundle, state, 4)  # move everything on
    assert sw.load(tmp_path, bundle) == state
    assert all(torch.equal(v, snapshot[k]) for k, v in bundle.model.state_dict().items())
    for k, s in bundle.optimizer.state_dict()["state"].items():
        assert all(torch.equal(t, opt_snapshot[k][n]) for n, t in s.items())
    assert bundle.optimizer.param_groups[0]["lr"] == lr and bundle.scheduler.last_epoch == 3
    assert torch.equal(torch.get_rng_state(), rng)


def test_keep_last_prunes_older_complete_checkpoints(tmp_path):
    bundle = build([], accumulate=1)
    state = bundle.init()
    for _ in range(4):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state, keep_last=2)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step_")) == [
        "step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_loading_into_another_model_lists_the_differences(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path, bundle, state)
    torch.manual_seed(0)
    other = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=3)
    wider = sw.pipeline(sw.Env())(other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(CheckpointError) as info:
        sw.load(tmp_path, wider)
    assert "missing keys [model.layers.2.attn.in_proj_weight" in str(info.value)
    mlp = sw.pipeline(sw.Env())(TinyMLP(), None)
    with pytest.raises(CheckpointError, match="unexpected keys .model.embed.weight"):
        sw.load(tmp_path, mlp)
    narrow = TinyTransformerLM(vocab=32, dim=8, heads=2, layers=2)
    with pytest.raises(CheckpointError, match=r"model.embed.weight: checkpoint \(32, 16\), model \(32, 8\)"):
        sw.load(tmp_path, sw.pipeline(sw.Env())(narrow, None))


def test_partial_and_corrupt_checkpoints_are_reported(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    first = sw.save(tmp_path, bundle, state)
    state, _ = train_for(bundle, state, 1)
    second = sw.save(tmp_path, bundle, state)
    (second / "shardwise.json").unlink()  # partial: never taken as latest
    assert sw.latest_checkpoint(tmp_path) == first
    (first / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="partial or corrupt"):
        sw.load(first, bundle)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        sw.load(tmp_path / "nothing", bundle)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_never_unpickles_foreign_objects(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    path = sw.save(tmp_path, bundle, state)
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its checksum"):
        sw.load(path, bundle)
    reseal(path)  # an attacker rewrites the checksums too: the allow-list still refuses
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        sw.load(path, bundle)


def test_unwritable_directory_and_mid_window_saves_are_refused(tmp_path):
    bundle = build([], accumulate=2)
    state, _ = train_for(bundle, bundle.init(), 1)
    with pytest.raises(CheckpointError, match="inside an accumulation window of 2"):
        sw.save(tmp_path, bundle, state)
    state, _ = train_for(bundle, state, 1)
    previous = sw.save(tmp_path / "ok", bundle, state)
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        sw.save(blocker / "sub", bundle, state)
    with pytest.raises(ValueError, match="'keep_last' must be an integer >= 1 or None .got 0"):
        sw.save(tmp_path, bundle, state, keep_last=0)
    assert sw.latest_checkpoint(tmp_path / "ok") == previous


def test_a_full_disk_during_save_raises_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno


    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    previous = sw.save(tmp_path, bundle, state)

    import torch.distributed.checkpoint as dcp

    class FullDisk(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "FileSystemWriter", FullDisk)  # imported when save() runs
    state, _ = train_for(bundle, state, 1)
    with pytest.raises(CheckpointError, match="no space left on device writing .*tmp.step_00000002"
                                              ".*previous checkpoint is intact"):
        sw.save(tmp_path, bundle, state)
    assert sw.latest_checkpoint(tmp_path) == previous
    assert not (tmp_path / "step_00000002").exists()
    assert sw.load(tmp_path, bundle).step == 1


@pytest.mark.parametrize("payload, shown", [
    (b"ctorch.distributed.checkpoint.metadata\nos.system\n.", "metadata.os.system"),
    (b"ctorch.distributed.checkpoint.filesystem\nFileSystemWriter\n.", "FileSystemWriter"),
    (b"cio\nFileIO\n.", "io.FileIO"),
])
def test_the_metadata_allow_list_takes_exact_names_only(tmp_path, payload, shown):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    path = sw.save(tmp_path, bundle, state)
    (path / ".metadata").write_bytes(payload)
    reseal(path)  # past the checksums, as a forger would go
    with pytest.raises(CheckpointError, match=rf"\.metadata: .*refers to .*{shown}"):
        sw.load(path, bundle)  # the file named, the refused name shown


def test_saving_before_the_first_step_changes_nothing(tmp_path):
    bundle = build([], accumulate=1)
    sw.save(tmp_path, bundle, bundle.init())
    assert len(bundle.optimizer.state) == 0  # AdamW would otherwise count a step


def test_a_model_only_bundle_loads_a_training_checkpoint(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 2)
    sw.save(tmp_path, bundle, state)
    torch.manual_seed(5)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2, dropout=0.1)
    evaluation = sw.pipeline(sw.Env())(model)
    assert sw.load(tmp_path, evaluation).step == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 bundle.model.state_dict().values(), strict=True))


def test_tuples_in_optimizer_settings_stay_tuples(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    groups = bundle.optimizer.state_dict()["param_groups"]
    sw.save(tmp_path, bundle, state)
    fresh = build([], accumulate=1)
    sw.load(tmp_path, fresh)
    assert fresh.optimizer.state_dict()["param_groups"] == groups
    assert isinstance(fresh.optimizer.param_groups[0]["betas"], tuple)


def test_reloading_after_a_resumed_epoch_returns_to_the_saved_batch(tmp_path):
    bundle = build([], accumulate=1)  # one process: 12 batches an epoch
    state, _ = train_for(bundle, bundle.init(), 5)
    sw.save(tmp_path, bundle, state)
    sw.load(tmp_path, bundle)
    train_for(bundle, state, 2)
    assert bundle.loader.epoch_length() == 12
    sw.load(tmp_path, bundle)
    first = next(iter(bundle.loader))
    assert (bundle.loader.epoch, bundle.loader.batch_in_epoch) == (0, 6)
    again = build([], accumulate=1)
    train_for(again, again.init(), 5)
    assert torch.equal(first["input_ids"], next(iter(again.loader))["input_ids"]) is False
    sw.load(tmp_path, again)
    assert torch.equal(first["input_ids"], next(iter(again.loader))["input_ids"])


def test_a_different_sampler_seed_is_refused(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path, bundle, state)
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2, dropout=0.1)
    loader = DataLoader(SyntheticTokens(size=48, seq_len=8), batch_size=4, shuffle=True)
    other = sw.pipeline(sw.Env(), sw.distribute_data(seed=7))(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), loader)
    with pytest.raises(CheckpointError, match="sampler seed 0, this loader uses 7"):
        sw.load(tmp_path, other)


def test_a_missing_shard_file_is_a_partial_checkpoint(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    path = sw.save(tmp_path, bundle, state)
    for shard_file in path.glob("*.distcp"):
        shard_file.unlink()
    with pytest.raises(CheckpointError, match="partial or corrupt"):
        sw.load(path, bundle)


def test_keep_last_after_a_rollback_and_debris_cleanup(tmp_path):
    bundle = build([], accumulate=1)
    state = bundle.init()
    for _ in range(3):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state)
    (tmp_path / ".tmp.step_00000009").mkdir()  # an interrupted save of another step
    rolled_back = sw.TrainState(step=2, micro_step=2)
    sw.save(tmp_path, bundle, rolled_back, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".shardwise.lock", "latest", "step_00000001", "step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


def test_keep_last_never_deletes_the_users_own_copies(tmp_path):
    import shutil

    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path, bundle, state)
    for copy in ("step_00000001.bak", "step_best", "step_00000000"):  # the user's copies
        shutil.copytree(tmp_path / "step_00000001", tmp_path / copy)
    for _ in range(3):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state, keep_last=1)
    names = sorted(os.listdir(tmp_path))
    assert names == [".shardwise.lock", "latest", "step_00000000", "step_00000001.bak",
                     "step_00000004", "step_best"]


def test_a_damaged_or_foreign_latest_marker_falls_back_to_the_newest_checkpoint(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(tmp_path / "run", bundle, state)
    state, _ = train_for(bundle, state, 1)
    newest = sw.save(tmp_path / "run", bundle, state)
    sw.save(tmp_path / "other_run", bundle, state)
    marker = tmp_path / "run" / "latest"
    for content in (b"\xff\xfe\x00garbage", b"../other_run/step_00000002", b"step_00000001/..",
                    str(tmp_path / "other_run" / "step_00000002").encode(), b"step_00000009"):
        marker.write_bytes(content)
        assert sw.latest_checkpoint(tmp_path / "run") == newest, content
    assert sw.load(tmp_path / "run", bundle).step == 2


def test_a_missing_or_corrupt_rng_file_fails_the_load_before_anything_changes(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 2)
    path = sw.save(tmp_path, bundle, state)
    train_for(bundle, state, 2)
    before = full_state(bundle.model)
    rng = path / "rng" / "rank_00000.json"
    for damage in ("{not json", '{"torch": "AAAA", "python": [3, [], null]}', None):
        if damage is None:
            rng.unlink()
        else:
            rng.write_text(damage)
        with pytest.raises(CheckpointError, match="rank_00000.json"):
            sw.load(tmp_path, bundle)
        after = full_state(bundle.model)
        assert all(torch.equal(after[k], before[k]) for k in before)  # nothing restored


class WithExtraState(torch.nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.extra = extra

    def forward(self, x):
        return self.fc(x).sum()

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_extra_state_round_trips_as_plain_data_and_never_runs_code(tmp_path, monkeypatch):
    import shardwise.checkpoint.save_load as checkpoint

    plain = WithExtraState({"calls": 3, "names": ["a", "b"], "scale": torch.ones(2)})
    bundle = sw.pipeline(sw.Env())(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    sw.save(tmp_path / "plain", bundle, bundle.init())
    plain.extra = {"calls": 0, "names": [], "scale": torch.zeros(2)}
    sw.load(tmp_path / "plain", bundle)
    assert plain.extra["calls"] == 3 and torch.equal(plain.extra["scale"], torch.ones(2))

    marker = tmp_path / "ran"
    hostile = WithExtraState(Payload(marker))
    bundle = sw.pipeline(sw.Env())(hostile, torch.optim.SGD(hostile.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="'_extra_state'.*not plain data"):
        sw.save(tmp_path / "hostile", bundle, bundle.init())
    # a checkpoint written without that check (another tool, or an older shardwise)
    monkeypatch.setattr(checkpoint, "_refuse_code", lambda model_sd: None)
    sw.save(tmp_path / "hostile", bundle, bundle.init())
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not plain data.*could run code"):
        sw.load(tmp_path / "hostile", bundle)
    assert not marker.exists()  # nothing ran


def reseal(path):
    """Rewrite checksums.json to match the files as they are now (a forger would)."""
    from shardwise.checkpoint import integrity as _integrity

    files = {}
    for rank in range(2):
        files.update({name: sha for name, (sha, _) in _integrity.digests_of(path, rank).items()})
    (path / _integrity.MANIFEST).write_text(json.dumps(
        {"files": files, "sealed": _integrity._sealed(files)}))


def flip_bit(file, offset):
    data = bytearray(file.read_bytes())
    data[offset % len(data)] ^= 0x10
    file.write_bytes(bytes(data))


def test_a_flipped_bit_anywhere_is_named_and_the_load_falls_back(tmp_path, caplog):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    older = sw.save(tmp_path, bundle, state)
    state, _ = train_for(bundle, state, 1)
    newest = sw.save(tmp_path, bundle, state)
    manifest = json.loads((newest / "checksums.json").read_text())["files"]
    assert set(manifest) == {"__0_0.distcp", ".metadata", "shardwise.json", "rng/rank_00000.json"}
    for name, offset in (("__0_0.distcp", 12345), (".metadata", 100), ("shardwise.json", 40),
                         ("rng/rank_00000.json", 20), ("checksums.json", 30)):
        saved = (newest / name).read_bytes()
        flip_bit(newest / name, offset)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            sw.load(newest, bundle)  # an explicit step: no fallback
        with caplog.at_level("WARNING"):
            assert sw.load(tmp_path, bundle).step == 1  # the newest intact one, said so
        assert newest.name in caplog.text and older.name != newest.name  # said which
        (newest / name).write_bytes(saved)
        caplog.clear()
    assert sw.load(tmp_path, bundle).step == 2


def test_a_load_that_fails_reading_tensors_leaves_the_bundle_as_it_was(tmp_path):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 2)
    path = sw.save(tmp_path, bundle, state)
    train_for(bundle, state, 2)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated...
    reseal(path)  # ...past the checksums (an I/O fault after verification reads the same)
    before = (full_state(bundle.model), _optimizer_tensors(bundle.optimizer),
              bundle.scheduler.state_dict(), torch.get_rng_state())
    with pytest.raises(CheckpointError, match="nothing was restored"):
        sw.load(path, bundle)
    after = (full_state(bundle.model), _optimizer_tensors(bundle.optimizer),
             bundle.scheduler.state_dict(), torch.get_rng_state())
    assert all(torch.equal(after[0][k], before[0][k]) for k in before[0])
    assert after[1].keys() == before[1].keys()
    assert all(torch.equal(after[1][k], before[1][k]) for k in before[1])
    assert after[2] == before[2] and torch.equal(after[3], before[3])


# -- found by the property tests (tests/unit/test_checkpoint_properties.py) ----------------------

def two_checkpoints(root):
    """Steps 1 and 2 of a one-process bundle saved in ``root``: the bundle and both paths."""
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    older = sw.save(root, bundle, state)
    state, _ = train_for(bundle, state, 1)
    return bundle, older, sw.save(root, bundle, state)


@pytest.mark.parametrize("name, replace", [
    ("__0_0.distcp", lambda p: os.symlink(p.name, p)),  # a loop: was a RuntimeError
    ("checksums.json", os.mkfifo),  # was skipped as absent: the checkpoint loaded unverified
    ("rng/rank_00000.json", lambda p: os.symlink("/dev/zero", p)),  # endless: never read
])
def test_a_symlink_loop_a_fifo_or_a_device_is_named_and_never_read(tmp_path, name, replace):
    bundle, older, newest = two_checkpoints(tmp_path)
    (newest / name).unlink()
    replace(newest / name)
    with within(60):
        with pytest.raises(CheckpointError, match=re.escape(str(newest / name))):
            sw.load(newest, bundle)
        assert sw.load(tmp_path, bundle).step == 1


def test_a_checkpoint_that_lost_its_checksums_is_refused_unless_it_predates_them(tmp_path):
    bundle, older, newest = two_checkpoints(tmp_path)
    (newest / "checksums.json").unlink()
    flip_bit(newest / "__0_0.distcp", 5000)  # in a weight: was loaded, unverified, as it is
    with pytest.raises(CheckpointError, match=r"step_00000002/checksums\.json is missing"):
        sw.load(newest, bundle)
    assert sw.load(tmp_path, bundle).step == 1
    meta = json.loads((older / "shardwise.json").read_text())
    assert meta["checksums"] == "checksums.json"
    del meta["checksums"], meta["engine"], meta["parts"]  # as written before: loaded unverified
    (older / "shardwise.json").write_text(json.dumps(meta))
    (older / "checksums.json").unlink()
    assert sw.load(older, bundle).step == 1


def test_shardwise_json_is_read_with_a_size_bound(tmp_path):
    bundle, older, newest = two_checkpoints(tmp_path)
    meta = (newest / "shardwise.json").read_text()
    (newest / "shardwise.json").write_text(meta + " " * (16 * 2**20))  # still valid JSON
    reseal(newest)
    with pytest.raises(CheckpointError, match=r"shardwise\.json is larger than 16777216 bytes"):
        sw.load(newest, bundle)
    assert sw.load(tmp_path, bundle).step == 1  # not taken as the latest either


def test_an_incomplete_checkpoint_is_named_with_what_it_lacks(tmp_path):
    bundle, older, newest = two_checkpoints(tmp_path)
    (newest / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000002 is not a complete checkpoint: "
                                              r".*step_00000002/\.metadata missing"):
        sw.load(newest, bundle)
    (older / "shardwise.json").unlink()
    with pytest.raises(CheckpointError, match="not complete, or not published here: "
                                              "step_00000001, step_00000002"):
        sw.load(tmp_path, bundle)


@pytest.mark.parametrize("payload", [b"\x80\x09.", b"\x82\x04."])
def test_a_damaged_metadata_pickle_is_a_checkpoint_error_whatever_it_raises(tmp_path, payload):
    bundle, _, newest = two_checkpoints(tmp_path)
    (newest / ".metadata").write_bytes(payload)  # ValueError from the unpickler: it escaped
    reseal(newest)
    with pytest.raises(CheckpointError, match=r"\.metadata: ValueError.*partial or corrupt"):
        sw.load(newest, bundle)


def test_finding_the_checkpoint_to_load_reads_one_shardwise_json(tmp_path, monkeypatch):
    from shardwise.checkpoint import layout as _layout

    bundle = build([], accumulate=1)
    state = bundle.init()
    for _ in range(4):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state)
    read, real = [], _layout.read_json
    monkeypatch.setattr(_layout, "read_json", lambda path, *a: read.append(path.parent.name)
                        or real(path, *a))
    assert sw.load(tmp_path, bundle).step == 4
    assert read == ["step_00000004"]  # was every step's
    (tmp_path / "latest").write_text("damaged")
    read.clear()
    assert sw.latest_checkpoint(tmp_path).name == "step_00000004"
    assert read == ["step_00000004"]  # newest first, lazily
