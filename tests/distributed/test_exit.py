# Leaving a job: the group shardwise started is met on the store and destroyed at exit.
import os
import subprocess
import sys
import time

import pytest

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


FAILING = """
import torch, shardwise as sw
from torch.utils.data import DataLoader
from shardwise.testing import SyntheticRegression, TinyMLP
torch.manual_seed(0)
model = TinyMLP()
loader = DataLoader(SyntheticRegression(size=64), batch_size=4)
env = sw.detect()
bundle = sw.pipeline(env, sw.replicate())(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
state = bundle.init()
for epoch in range(10_000):  # rank 0 trains on, blocked in DDP's all-reduce once rank 1 is gone
    for batch in bundle.loader:
        state, out = bundle.step(state, batch)
        if env.rank == 1 and state.step == 3:
            raise RuntimeError("rank 1 fails mid-training")
"""


def test_a_rank_that_raises_ends_the_job_within_seconds(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 fails mid-training" in proc.stderr
    assert "leaving at once, without the exit barrier" in proc.stderr
    # torchrun's start-up is ~5 s here; waiting at the exit barrier took 60 s more
    assert took < 15, (took, proc.stderr[-2000:])


STALLING = """
import time, torch, shardwise as sw
env = sw.detect(timeout=4)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
bundle = sw.pipeline(env, sw.replicate(), sw.accumulate_gradients(2))(
    model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda m, b: m(b).pow(2).mean())
state = bundle.init()
for i in range(8):
    if env.rank == 1 and i == 5:
        print("rank 1 stalls", flush=True)
        time.sleep(300)  # stops reaching the collectives, without failing
    state, out = bundle.step(state, torch.ones(2, 4))
"""


def test_a_stalled_rank_is_named_and_the_job_ends_within_the_timeout(tmp_path):
    script = tmp_path / "stalling.py"
    script.write_text(STALLING)
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--num_processes", "2", str(script)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "SHARDWISE_CONFIG_DIR": str(tmp_path)})
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    # rank 0 names the step, the micro-step and the part of it, and the rank that went silent
    assert ("CollectiveError: rank 0: a collective failed at optimizer step 3 (micro-step 6), "
            "forward and backward") in proc.stderr, proc.stderr[-3000:]
    assert "rank(s) 1 did not report within 3 s: stalled or gone" in proc.stderr
    # the launcher's last line says which rank failed first, with its exception
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shardwise launch: rank 0 failed first (exit code 1): "
                           "CollectiveError: rank 0: a collective failed at optimizer step 3"), last
    # start-up (~5-10 s here) + the 4 s timeout + 3 s for the peers' reports, not 300 s
    assert took < 60, (took, proc.stderr[-2000:])


TRAINER_GROUP = """
import sys, torch, torch.distributed as dist
from transformers import TrainingArguments
import shardwise as sw
from shardwise.testing import TinyMLP
args = TrainingArguments(output_dir=".", use_cpu=True, report_to=[])
assert args.world_size == 2 and dist.is_initialized()  # TrainingArguments started the group
trainer = sw.Trainer(model=TinyMLP(), args=args)
gathered = trainer.accelerator.gather_for_metrics(torch.tensor([float(dist.get_rank())]))
def say(line):  # one write per line: the two ranks share torchrun's stdout
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()
say(f"gathered {gathered.tolist()}")
destroy = dist.destroy_process_group
def reporting_destroy():
    say("left the group")
    destroy()
dist.destroy_process_group = reporting_destroy
"""


def test_the_group_trainingarguments_started_is_left_as_shardwise_leaves_its_own(tmp_path):
    """The Trainer's group (Accelerate's PartialState starts it and leaves it standing) is
    met on the store and destroyed at exit: the script need not destroy it itself."""
    pytest.importorskip("transformers")
    script = tmp_path / "trainer_group.py"
    script.write_text(TRAINER_GROUP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gathered [0.0, 1.0]") == 2, proc.stdout
    assert proc.stdout.count("left the group") == 2, proc.stdout + proc.stderr[-2000:]
    assert "NOT been destroyed" not in proc.stderr, proc.stderr[-2000:]
