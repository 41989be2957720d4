# Checkpoints as transactions: one writer per root, crash at every file operation, forged metadata.
# Its tests that start no process are in tests/unit/test_checkpoint_manifest.py.
import builtins
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import lock
from shardwise.errors import CheckpointError

from _checkpointing import equal, saved_two
from conftest import build_lm, train_for

# -- one writer per root ------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import json, sys
    import torch
    import shardwise as sw
    from shardwise.testing import TinyMLP
    root, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(first)
    model = TinyMLP()
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = bundle.init()
    returned = []
    for i in range(count):
        state, _ = bundle.step(state, (torch.randn(4, 8), torch.randn(4, 1)))
        state = state.__class__(**{**state.to_dict(), "step": first + i})
        path = sw.save(root, bundle, state, keep_last=None)
        returned.append([str(path), {k: v.tolist() for k, v in model.state_dict().items()}])
    print(json.dumps(returned))
""")


def test_two_jobs_saving_to_one_root_publish_only_checkpoints_that_load(tmp_path):
    root = tmp_path / "shared"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, str(script), str(root), str(first), "16"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for first in (100, 200)]
    outputs = [job.communicate(timeout=240) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-2000:] for _, err in outputs]
    returned = [item for out, _ in outputs for item in json.loads(out)]
    assert len(returned) == 32
    torch.manual_seed(0)
    model = sw.testing.TinyMLP()
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for path, weights in returned:
        state = sw.load(path, bundle)
        assert state.step == int(path.rsplit("_", 1)[1])
        for name, value in model.state_dict().items():
            assert value.tolist() == weights[name], (path, name)
    assert not list(root.glob(".tmp.*")) and not list(root.glob(".old.*"))


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from shardwise.checkpoint import lock
    held = lock.acquire(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_second_writer_waits_then_is_refused_naming_the_holder_and_a_dead_holder_frees_it(
        tmp_path, monkeypatch):
    root = tmp_path / "root"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"within 0.5 s .*the last writer was pid "
                                                   rf"{holder.pid} on host {socket.gethostname()}"):
            lock.acquire(root, wait=0.5)
        assert time.monotonic() - started >= 0.5
        bundle = build_lm([], accumulate=1)
        state, _ = train_for(bundle, bundle.init(), 1)
        monkeypatch.setattr(lock, "WAIT_SECONDS", 0.3)
        with pytest.raises(CheckpointError, match=rf"pid {holder.pid}"):
            sw.save(root, bundle, state)
        assert not list(root.glob("*step*"))  # nothing was touched while refused
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released the dead holder's lock: no stale lock to clear by hand
    assert sw.save(root, bundle, state).name == "step_00000001"


def test_a_load_holds_the_root_against_another_jobs_save_and_waits_for_one(tmp_path):
    bundle, state, first, second = saved_two(tmp_path)
    reading = lock.share(tmp_path)  # as sw.load holds it on rank 0 while the ranks read
    try:
        with pytest.raises(CheckpointError, match="saving to or loading from"):
            lock.acquire(tmp_path, wait=0.3)  # another job's save (and keep_last) waits
    finally:
        reading.release()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"last writer was pid {holder.pid}"):
            lock.share(tmp_path, wait=0.3)  # a load waits for a save in flight
        assert time.monotonic() - started >= 0.3
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert sw.load(tmp_path, bundle).step == 2
    assert lock.share(tmp_path / "nowhere") is None  # a root no save wrote: nothing to hold


# -- a kill after every file operation of a save and of a re-save ----------------------------

class Killer:
    """Counts the file operations of the code it wraps; the ``at``-th never returns."""

    OS_CALLS = ("rename", "replace", "mkdir", "unlink", "rmdir", "fsync", "open", "ftruncate")

    def __init__(self, at):
        self.at, self.count = at, 0

    def tick(self):
        self.count += 1
        if self.count == self.at:
            os._exit(9)

    def install(self):
        for name in self.OS_CALLS:
            real = getattr(os, name)

            def wrapped(*args, _real=real, _name=name, **kwargs):
                if _name != "open" or args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                    self.tick()
                return _real(*args, **kwargs)
            setattr(os, name, wrapped)
        real_open = io.open

        def opened(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                self.tick()
            return real_open(file, mode, *args, **kwargs)
        builtins.open = io.open = opened


def run_killed(at, work):
    """Fork; the child runs ``work`` killed at file operation ``at``; its count of operations
    (when it was not killed) or None."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # never return into the test runner's stack
        try:
            os.close(read)
            killer = Killer(at)
            killer.install()
            work()
            os.write(write, str(killer.count).encode())
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        counted = stream.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 9), status
    return int(counted) if counted else None


def weights(bundle):
    return {k: v.detach().clone() for k, v in bundle.model.state_dict().items()}


@pytest.mark.parametrize("resave", [False, True], ids=["new step", "same step again"])
def test_a_kill_after_any_file_operation_leaves_the_old_or_the_new_checkpoint(tmp_path, resave):
    pristine = tmp_path / "pristine"
    bundle, state, first, second = saved_two(pristine)
    old = weights(bundle)
    state, _ = train_for(bundle, state, 1)
    new = weights(bundle)
    target = state if not resave else sw.TrainState(step=2, micro_step=2, epoch=state.epoch,
                                                    batch_in_epoch=state.batch_in_epoch)
    root = tmp_path / "root"

    def save():
        sw.save(root, bundle, target, keep_last=1)

    reference = sw.save(tmp_path / "reference", bundle, target)  # the state each child saves
    shutil.copytree(pristine, root)
    total = run_killed(10**9, save)
    assert total and total > 8
    for at in range(1, total + 1):
        shutil.rmtree(root)
        shutil.copytree(pristine, root)
        sw.load(reference, bundle)
        assert run_killed(at, save) is None
        assert sw.latest_checkpoint(root) is not None, at
        loaded = sw.load(root, bundle)
        got = weights(bundle)
        if resave:
            assert loaded.step == 2 and (equal(got, old) or equal(got, new)), at
        else:
            assert (loaded.step, equal(got, old), equal(got, new)) in {
                (2, True, False), (3, False, True)}, at
        # the next save recovers what the kill left, instead of deleting it
        sw.save(root, bundle, sw.TrainState(step=7, micro_step=7))
        assert sw.load(root / f"step_{loaded.step:08d}", bundle).step == loaded.step, at
        assert equal(weights(bundle), got), at
        assert not [p for p in root.iterdir() if p.name.startswith((".old", ".tmp", ".trash"))]


# -- two writers, random saves, kills and keep_last ------------------------------------------

def writer(root, bundle, saves, kill_at, report):
    """A forked writer: ``saves`` as (step, keep_last); killed at file operation ``kill_at``
    (None: never). Each path sw.save returned is written to ``report`` at once."""
    def work():
        for step, keep in saves:
            path = sw.save(root, bundle, sw.TrainState(step=step, micro_step=step),
                           keep_last=keep)
            os.write(report, f"{path.name}\n".encode())

    pid = os.fork()
    if pid == 0:  # never return into the test runner's stack
        try:
            if kill_at is not None:
                Killer(kill_at).install()
            work()
        except BaseException as exc:
            os.write(report, f"error {type(exc).__name__}: {exc}\n".encode())
            os._exit(1)
        os._exit(0)
    return pid


def check_two_writers(data, root, bundle, reference):
    from hypothesis import strategies as st

    plans = []
    for first in (10, 20):  # everything drawn before any fork
        saves = data.draw(st.lists(st.tuples(st.integers(first, first + 3),
                                             st.sampled_from([None, 1, 2])),
                                   min_size=1, max_size=3))
        plans.append((saves, data.draw(st.one_of(st.none(), st.integers(1, 60)))))
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(reference, root)  # step 1, published
    read, report = os.pipe()
    pids = [writer(root, bundle, saves, kill_at, report) for saves, kill_at in plans]
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(report)
    with os.fdopen(read) as stream:
        lines = stream.read().splitlines()
    assert not [line for line in lines if line.startswith("error")], lines
    reported = set(lines)
    assert sw.latest_checkpoint(root) is not None
    for path in root.glob("step_*"):  # whatever is published loads
        assert sw.load(path, bundle).step == int(path.name[5:])
    # what loads is step 1 or one a writer saved: returned by sw.save, or published by a save
    # killed before it returned (in its keep_last, say, after it pruned the others)
    state = sw.load(root, bundle)
    name = f"step_{state.step:08d}"
    killed = any(kill_at is not None for _, kill_at in plans)
    attempted = {f"step_{step:08d}" for saves, _ in plans for step, _ in saves}
    assert name in reported | {"step_00000001"} or (killed and name in attempted), (name, reported)
    sw.save(root, bundle, sw.TrainState(step=99, micro_step=99))  # recovers, removes debris
    assert not [p for p in root.iterdir() if p.name.startswith((".old", ".tmp", ".trash"))]


@pytest.mark.properties
def test_two_writers_saving_killing_and_pruning_at_random_leave_a_reported_checkpoint(tmp_path):
    """CI runs 12 examples; HYPOTHESIS_PROFILE=long runs the long profile's count."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    reference = tmp_path / "reference"
    sw.save(reference, bundle, state)
    count = 12 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else None
    chosen = settings(database=None, **({"max_examples": count} if count else {}))
    chosen(given(st.data())(
        lambda data: check_two_writers(data, tmp_path / "root", bundle, reference)))()


# -- a kill after every file operation of an export ------------------------------------------

def test_a_kill_after_any_file_operation_of_an_export_leaves_the_old_or_the_new_one(tmp_path):
    """sw.export killed after each of its file operations (staging, DCP's pieces, the
    consolidation, the config, the two renames): the name holds the whole old export (with
    the user's file in it) or the whole new one, never a mix or nothing; the next export
    finishes or clears what the kill left, so nothing stays beside it."""
    from safetensors.torch import load_file

    from shardwise.testing import TinyTransformerLM

    def bundle_of(seed):
        torch.manual_seed(seed)
        model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
        return sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))

    old, new = bundle_of(0), bundle_of(1)
    pristine, out = tmp_path / "pristine", tmp_path / "root" / "final"
    sw.export(pristine, old)
    (pristine / "tokenizer.json").write_text("{}")
    expected = {"old": weights(old), "new": weights(new)}

    def export():
        sw.export(out, new)

    def fresh():
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir()
        shutil.copytree(pristine, out)

    fresh()
    total = run_killed(10**9, export)
    assert total and total > 6
    between = 0
    for at in range(1, total + 1):
        fresh()
        assert run_killed(at, export) is None
        if not out.exists():  # killed between the renames: the old one is set aside whole
            between += 1
            assert equal(load_file(out.parent / ".final.export.old" / "model.safetensors"),
                         expected["old"]), at
        else:
            got = load_file(out / "model.safetensors")
            assert equal(got, expected["old"]) or equal(got, expected["new"]), at
            assert (out / "tokenizer.json").exists(), at
        sw.export(out, new)  # puts a set-aside export back first: the user's file survives
        assert equal(load_file(out / "model.safetensors"), expected["new"]), at
        assert (out / "tokenizer.json").exists(), at
        assert [p.name for p in out.parent.iterdir()] == ["final"], at
    assert between >= 1
