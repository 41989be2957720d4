# Property-based tests: a checkpoint damaged at random loads exactly, or fails naming the damage.
"""Checkpoint files written by ``sw.save`` (one process: a tiny LM, AdamW, StepLR; steps 1 and
2 with different weights) are copied and damaged at random: a file truncated, a bit flipped,
a file deleted, a foreign file or a copy of a checkpoint added, a file replaced by a symlink
(inside the root, outside it, to itself, dangling, to a FIFO or ``/dev/zero``) or by a
directory, a directory by a file, ``latest`` by random bytes; or a file truncated or deleted
past its checksums (rewritten to match). Then ``sw.load`` on the root and on each damaged step
directory (the newest when none is) either restores exactly what the checkpoint it reports
(the returned state's step) held, or raises ``CheckpointError`` naming the damaged step and
leaves the bundle exactly as it was. Never another exception, never a hang (an alarm). That
nothing runs on load is held by the forged-payload tests in test_checkpoint.py.

The ci profile runs 60 examples a test (derandomized); the long run is
``HYPOTHESIS_PROFILE=long pytest -m long tests/unit/test_checkpoint_properties.py``: 2000 examples,
up to three damages at once.
"""
import copy
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.checkpoint import integrity as _integrity
from shardwise.errors import CheckpointError

from conftest import build_lm, train_for, within

pytestmark = pytest.mark.properties

STEPS = ("step_00000001", "step_00000002")
FILES = (".metadata", "__0_0.distcp", "checksums.json", "shardwise.json", "rng/rank_00000.json")
STEP_FILES = tuple(f"{step}/{name}" for step in STEPS for name in FILES)
ALL_FILES = ("latest", *STEP_FILES)
DIRECTORIES = (*STEPS, *(f"{step}/rng" for step in STEPS))


class Saved:
    """The saved root, the bundle the examples load into, and what each step held."""

    def __init__(self, root, bundle, states, snapshots, baseline):
        self.root, self.bundle, self.states = root, bundle, states  # step -> TrainState
        self.snapshots = snapshots  # step -> snapshot() when it was saved
        self.baseline = baseline  # model, optimizer and scheduler state to reset the bundle to

    def __repr__(self):
        return f"Saved({self.root})"


def snapshot(bundle):
    """Everything a load may change, as copies."""
    optim = bundle.optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in bundle.model.state_dict().items()},
        "optimizer": {(i, n): t.clone() for i, s in optim["state"].items() for n, t in s.items()},
        "groups": copy.deepcopy(optim["param_groups"]),
        "scheduler": copy.deepcopy(bundle.scheduler.state_dict()),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
        "loader": (bundle.loader._next_epoch, bundle.loader._resume_at),
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 saved once for the module, and a bundle moved on to a third state."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    bundle = build_lm([], accumulate=1)
    state, states, snapshots = bundle.init(), {}, {}
    for _ in STEPS:
        state, _ = train_for(bundle, state, 1)
        states[state.step], snapshots[state.step] = state, snapshot(bundle)
        sw.save(root, bundle, state)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(
        (".shardwise.lock", *ALL_FILES))
    train_for(bundle, state, 1)  # the bundle holds neither checkpoint's tensors
    baseline = (copy.deepcopy(bundle.model.state_dict()), copy.deepcopy(bundle.optimizer.state_dict()),
                copy.deepcopy(bundle.scheduler.state_dict()))
    return Saved(root, bundle, states, snapshots, baseline)


# -- damages: each applies itself to a copy of the root; `step` is the checkpoint it touches

def _step_of(relative):
    first = relative.split("/")[0]
    return first if first in STEPS else None


def _regular(path):
    return path.is_file() and not path.is_symlink()


def _remove(path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@dataclass(frozen=True)
class Truncate:
    file: str
    at: int

    step = property(lambda self: _step_of(self.file))

    def apply(self, root, outside):
        path = root / self.file
        if _regular(path):
            data = path.read_bytes()
            path.write_bytes(data[:self.at % len(data)] if data else b"")


@dataclass(frozen=True)
class FlipBit:
    file: str
    offset: int
    bit: int

    step = property(lambda self: _step_of(self.file))

    def apply(self, root, outside):
        path = root / self.file
        if _regular(path) and path.stat().st_size:
            data = bytearray(path.read_bytes())
            data[self.offset % len(data)] ^= 1 << self.bit
            path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Delete:
    file: str

    step = property(lambda self: _step_of(self.file))

    def apply(self, root, outside):
        _remove(root / self.file)


@dataclass(frozen=True)
class Foreign:
    """A file shardwise did not write, under a name it might look at."""
    where: str
    name: str
    content: bytes

    step = property(lambda self: _step_of(self.where))

    def apply(self, root, outside):
        directory = root / self.where
        if directory.is_dir() and not (directory / self.name).exists():
            (directory / self.name).write_bytes(self.content)


@dataclass(frozen=True)
class CopyStep:
    """A user's copy of a checkpoint under another name (never published there by shardwise)."""
    source: str
    name: str

    step = None

    def apply(self, root, outside):
        if (root / self.source).is_dir() and not (root / self.name).exists():
            shutil.copytree(root / self.source, root / self.name, symlinks=True)


@dataclass(frozen=True)
class Symlink:
    """``file`` replaced by a symlink: to itself, dangling, to another file of the root, to an
    identical copy beside it or outside the root, to a FIFO beside it, or to /dev/zero."""
    file: str
    to: str
    other: str

    step = property(lambda self: _step_of(self.file))

    def apply(self, root, outside):
        path = root / self.file
        if not path.parent.is_dir():
            return
        original = path.read_bytes() if _regular(path) else b"gone"
        _remove(path)
        if self.to == "self":
            target = path.name
        elif self.to == "dangling":
            target = "nothing_here"
        elif self.to == "inside":
            target = os.path.relpath(root / self.other, path.parent)
        elif self.to == "copy beside":
            (path.parent / f"{path.name}.copy").write_bytes(original)
            target = f"{path.name}.copy"
        elif self.to == "copy outside":
            target = str(outside / self.file.replace("/", "_"))
            Path(target).write_bytes(original)
        elif self.to == "fifo beside":
            target = f"{path.name}.fifo"
            if not os.path.lexists(path.parent / target):
                os.mkfifo(path.parent / target)
        else:
            target = "/dev/zero"
        os.symlink(target, path)


@dataclass(frozen=True)
class Latest:
    content: bytes

    step = None

    def apply(self, root, outside):
        _remove(root / "latest")
        (root / "latest").write_bytes(self.content)


@dataclass(frozen=True)
class DirectoryFor:
    """A directory (with a file inside) where a file is expected."""
    file: str

    step = property(lambda self: _step_of(self.file))

    def apply(self, root, outside):
        path = root / self.file
        if path.parent.is_dir():
            _remove(path)
            path.mkdir()
            (path / "inside").write_bytes(b"x")


@dataclass(frozen=True)
class FileFor:
    """A file where a directory (a checkpoint, or its rng/) is expected."""
    directory: str
    content: bytes

    step = property(lambda self: _step_of(self.directory))

    def apply(self, root, outside):
        path = root / self.directory
        if path.is_dir():
            _remove(path)
            path.write_bytes(self.content)


@dataclass(frozen=True)
class Resealed:
    """A damage, and checksums.json rewritten to match (as a forger would, or as an I/O fault
    after the verification reads): what the checkpoint code itself must survive."""
    damage: object

    step = property(lambda self: self.damage.step)

    def apply(self, root, outside):
        self.damage.apply(root, outside)
        if not (root / self.step).is_dir():
            return
        files = {}
        for path in sorted((root / self.step).rglob("*")):
            name = str(path.relative_to(root / self.step))
            if _regular(path) and name != _integrity.MANIFEST:
                files[name] = _integrity._digest(path)
        (root / self.step / _integrity.MANIFEST).write_text(json.dumps(
            {"files": files, "sealed": _integrity._sealed(files)}))


offsets = st.integers(0, 2**20)
files = st.sampled_from(ALL_FILES)
foreign_names = st.one_of(
    st.sampled_from(["__0_1.distcp", "__1_0.distcp", "rank_00001.json", ".metadata.tmp",
                     "shardwise.json.tmp", "latest.tmp", "step_00000003", ".tmp.step_00000003",
                     ".old.step_00000002", "step_00000002.bak", "checksums.json.tmp"]),
    st.text("abcxyz._-0123456789", min_size=1, max_size=12).map(lambda s: "foreign" + s))
latest_contents = st.one_of(
    st.binary(max_size=80),
    st.sampled_from([b"step_00000001", b"step_00000001\n", b"step_00000003\n", b"../ckpt/step_00000002",
                     b"step_00000002/..", b"/etc/passwd", b"step_00000002.bak", b"\n" * 70,
                     b"step_00000002" * 100_000]))

BYTES = st.one_of(st.builds(Truncate, files, offsets),
                  st.builds(FlipBit, files, offsets, st.integers(0, 7)))
STRUCTURE = st.one_of(
    st.builds(Delete, files),
    st.builds(Symlink, files, st.sampled_from(["self", "dangling", "inside", "copy beside",
                                               "copy outside", "fifo beside", "/dev/zero"]), files),
    st.builds(DirectoryFor, files),
    st.builds(FileFor, st.sampled_from(DIRECTORIES), st.binary(max_size=32)))
FOREIGN = st.one_of(
    st.builds(Foreign, st.sampled_from(("", *DIRECTORIES)), foreign_names, st.binary(max_size=64)),
    st.builds(CopyStep, st.sampled_from(STEPS),
              st.sampled_from(["step_00000003", "step_00000009", "step_best", "step_00000002.bak"])),
    st.builds(Latest, latest_contents))
DAMAGE = st.one_of(BYTES, STRUCTURE, FOREIGN)
# past the checksums: truncated or deleted files of the checkpoint itself
SEALED_FILES = st.sampled_from([f for f in STEP_FILES if not f.endswith("checksums.json")])
RESEALED = st.builds(Resealed, st.one_of(st.builds(Truncate, SEALED_FILES, offsets),
                                         st.builds(Delete, SEALED_FILES)))


# -- the property

def reset(saved):
    """Put the bundle in a state that is neither checkpoint's."""
    bundle, (model, optimizer, scheduler) = saved.bundle, saved.baseline
    bundle.model.load_state_dict(model)
    bundle.optimizer.load_state_dict(copy.deepcopy(optimizer))
    bundle.scheduler.load_state_dict(scheduler)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    bundle.loader.resume(5, 0)


def load_one(saved, target, damaged, latest_damaged, resealed):
    """Load ``target`` (the root or a step directory) and check the property."""
    reset(saved)
    before = snapshot(saved.bundle)
    explicit = target.name in STEPS
    try:
        state = sw.load(target, saved.bundle)
    except CheckpointError as exc:
        assert same(snapshot(saved.bundle), before), f"the failed load changed the bundle: {exc}"
        named = {step for step in damaged if step and step in str(exc)}
        assert named, f"the error names no damaged checkpoint of {sorted(map(str, damaged))}: {exc}"
        if explicit:
            assert target.name in damaged, f"an intact checkpoint failed to load: {exc}"
        elif not resealed:  # past its checksums a checkpoint is taken as intact: no fallback
            assert set(STEPS) <= damaged, f"the root failed with an intact checkpoint in it: {exc}"
        return
    assert state.step in saved.states, state
    expected = saved.snapshots[state.step]
    assert state == saved.states[state.step]
    got = snapshot(saved.bundle)
    for part in ("model", "optimizer", "groups", "scheduler", "rng"):
        assert same(got[part], expected[part]), f"{part} differs from step {state.step}'s"
    assert got["loader"] == (state.epoch, state.batch_in_epoch)
    if explicit:
        assert target.name == f"step_{state.step:08d}"
    elif STEPS[-1] not in damaged and not latest_damaged:
        assert state.step == 2, "the root loaded an older checkpoint though the newest is intact"


def check(saved, damages):
    with tempfile.TemporaryDirectory() as tmp:
        root, outside = Path(tmp) / "ckpt", Path(tmp) / "outside"
        shutil.copytree(saved.root, root, symlinks=True)
        outside.mkdir()
        for damage in damages:
            damage.apply(root, outside)
        damaged = {damage.step for damage in damages}
        latest_damaged = any(isinstance(d, Latest) or getattr(d, "file", "") == "latest"
                             for d in damages)
        resealed = any(isinstance(d, Resealed) for d in damages)
        # the root, and each damaged checkpoint explicitly (the newest when none is damaged:
        # an intact one must load from its own directory too)
        explicit = sorted(damaged - {None}) or [STEPS[-1]]
        with within(60):
            for target in (root, *(root / step for step in explicit)):
                load_one(saved, target, damaged, latest_damaged, resealed)


@given(damage=BYTES)
def test_a_truncated_file_or_a_flipped_bit_loads_exactly_or_is_named(saved, damage):
    check(saved, [damage])


@given(damage=STRUCTURE)
def test_a_deleted_symlinked_or_misplaced_entry_loads_exactly_or_is_named(saved, damage):
    check(saved, [damage])


@given(damage=FOREIGN)
def test_foreign_files_copies_and_a_random_latest_never_mislead_the_load(saved, damage):
    check(saved, [damage])


@given(damage=RESEALED)
def test_a_file_damaged_past_its_checksums_fails_before_anything_changes(saved, damage):
    check(saved, [damage])


@pytest.mark.long
@settings(settings.get_profile("long"))
@given(damages=st.lists(DAMAGE, min_size=1, max_size=3))
def test_long_up_to_three_damages_load_exactly_or_are_named(saved, damages):
    check(saved, damages)


@pytest.mark.long
@settings(settings.get_profile("long"))
@given(damage=RESEALED)
def test_long_files_damaged_past_their_checksums(saved, damage):
    check(saved, [damage])
