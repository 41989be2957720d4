# Leaving a job: the group shardwise started is met on the store and destroyed at exit.
import os
import subprocess
import sys
import time

from shardwise.testing import free_port

SCRIPT = """
import sys, time, torch, shardwise as sw
from torch.utils.data import DataLoader
from shardwise.testing import SyntheticRegression, TinyMLP
torch.manual_seed(0)
model = TinyMLP()
loader = DataLoader(SyntheticRegression(size=16), batch_size=4)
env = sw.detect()
bundle = sw.pipeline(env)(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
state = bundle.init()
for batch in bundle.loader:
    state, out = bundle.step(state, batch)
print("trained", env.rank, state.step, flush=True)
import torch.distributed as dist
after_training = dist.group.WORLD._get_sequence_number_for_group()
destroy = dist.destroy_process_group
def counting_destroy():
    extra = dist.group.WORLD._get_sequence_number_for_group() - after_training
    print("collectives at exit", extra, flush=True)
    destroy()
dist.destroy_process_group = counting_destroy
if env.rank == 1:
    time.sleep(float(sys.argv[1]))  # rank 1 reaches the exit barrier late
"""


def test_rank_0_hosting_the_store_leaves_after_the_others(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port, late = free_port(), 3.0
    base = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # without torchrun (env:// by hand) rank 0's own process hosts the TCPStore
    procs = [subprocess.Popen([sys.executable, str(script), str(late)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    start = time.monotonic()
    ends = {}
    while len(ends) < 2 and time.monotonic() - start < 120:
        for r, p in enumerate(procs):
            if r not in ends and p.poll() is not None:
                ends[r] = time.monotonic()
        time.sleep(0.05)
    outputs = [p.communicate(timeout=5) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # no gloo work is queued at exit (a gloo thread could drop it while the interpreter
    # finalizes); the ranks meet on the store instead
    assert [out.split("\n")[:2] for out, _ in outputs] == [
        [f"trained {r} 2", "collectives at exit 0"] for r in (0, 1)]
    # rank 0 waited at the exit barrier for rank 1, `late` s behind (not leaving ~late s before it)
    assert ends[0] >= ends[1] - 2.0 and ends[0] - start >= late, (ends, start)
    for _, err in outputs:
        assert "NOT been destroyed" not in err and "exit barrier failed" not in err, err
