# sw.load is all or nothing, starts a clean window, and resumes mid-epoch at any world size.
# Its tests that start no process are in tests/unit/test_checkpoint_load.py.
import subprocess
import sys
import textwrap

import shardwise as sw
from shardwise.testing import run_distributed

from _checkpointing import ids_bundle

# -- the data position: a global cursor, any world size ------------------------------------

def read_then_save(root, batch_size, batches):
    bundle = ids_bundle(batch_size)
    state, read = bundle.init(), []
    for batch in bundle.loader:
        read += batch[0][:, 0].int().tolist()
        state, _ = bundle.step(state, batch)
        if state.batch_in_epoch == batches:
            break
    sw.save(root, bundle, state)
    return read


def resume_and_read(root, batch_size):
    bundle = ids_bundle(batch_size)
    state = sw.load(root, bundle)
    read = []
    for batch in bundle.loader:
        read += batch[0][:, 0].int().tolist()
        state, _ = bundle.step(state, batch)
    return read, (state.epoch, state.batch_in_epoch)


def everything_read(first, second):
    return sorted(i for rank in first for i in rank) + sorted(i for rank in second for i in rank)


def test_a_mid_epoch_resume_at_another_world_size_reads_every_sample_once(tmp_path):
    root = str(tmp_path / "two")
    first = run_distributed(read_then_save, root, 4, 3)  # 2 ranks x 3 batches of 4: 24 read
    assert len(set(i for rank in first for i in rank)) == 24
    one = [resume_and_read(root, 4)[0]]  # 2 -> 1 rank
    four = [r for r, _ in run_distributed(resume_and_read, root, 2, world_size=4)]  # 2 -> 4, batch 2
    for second in (one, four):
        assert sorted(everything_read(first, second)) == list(range(64))
    assert all(len(rank) == 10 for rank in four)
    root = str(tmp_path / "one")
    first = [read_then_save(root, 4, 5)]  # 1 rank x 5 batches of 4: 20 read
    results = run_distributed(resume_and_read, root, 4)  # 1 -> 2 ranks
    second = [r for r, _ in results]
    assert sorted(everything_read(first, second)) == list(range(64))
    assert [position for _, position in results] == [(1, 0), (1, 0)]  # the epoch ended there


# -- a background save that fails unobserved ----------------------------------------------

FAILING = textwrap.dedent("""
    import errno
    import torch
    import shardwise as sw
    from torch.distributed.checkpoint import FileSystemWriter
    from shardwise.testing import TinyMLP

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    FileSystemWriter.write_data = full_disk
    model = TinyMLP()
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, _ = bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    handle = sw.save(sys.argv[1], bundle, state, blocking=False)
    try:
        handle.result(timeout="soon")
    except sw.errors.ArgumentError as exc:
        print(exc)
    print("the script ends without waiting")
""")


def test_a_background_save_that_fails_unobserved_exits_non_zero_naming_the_cause(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys\n" + FAILING, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert "'timeout' must be None or a finite number of seconds >= 0 (got 'soon')" in done.stdout
    assert "the script ends without waiting" in done.stdout
    assert done.returncode == 1, done.stderr[-2000:]
    assert "never waited for" in done.stderr and "no space left on device writing" in done.stderr
    assert "inline_container" not in done.stderr
