# The example script end to end: `python` and `torchrun --nproc_per_node=2`, as the README runs it.
import os
import re
import sys
from pathlib import Path

import pytest

from shardwise.testing import free_port

from _jobs import run_jobs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def run(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    [(code, out, err)] = run_jobs([cmd], env=env, timeout=180)
    assert code == 0, out + err
    return out, err


def losses(stdout):
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", stdout)]


@pytest.mark.parametrize("procs", [1, 2])
def test_example_trains_and_the_loss_falls(procs):
    args = [str(EXAMPLE), "--epochs", "2", "--log-every", "4"]
    if procs == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", *args]
    out, err = run(cmd)
    found = losses(out)
    assert len(found) >= 4 and found[-1] < 0.5 * found[0], out
    assert f"on {procs} process(es)" in out
    if procs == 2:
        assert "DistributedDataParallel over 2 ranks (gloo)" in out
        assert "(torchrun)" in out
    assert "has NOT been destroyed" not in err and "Traceback" not in err, err


FINETUNE = EXAMPLE.parent / "finetune_classifier.py"


def test_finetune_example_evaluates_exactly_and_resumes_on_two_processes(tmp_path):
    pytest.importorskip("transformers")

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(FINETUNE),
               *args]
        return run(cmd)[0]

    straight = torchrun("--epochs", "3", "--checkpoint-dir", str(tmp_path / "a"))
    torchrun("--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"))
    resumed = torchrun("--epochs", "3", "--checkpoint-dir", str(tmp_path / "b"))
    final = re.findall(r"epoch 3 step \d+: accuracy (\d\.\d+) over (\d+) samples on 2", straight)
    assert final and final[0][1] == "203"  # no padded sample counted twice
    assert float(final[0][0]) > 0.8, straight
    assert resumed.strip().splitlines()[-1] == straight.strip().splitlines()[-1]


TRAINER = EXAMPLE.parent / "trainer_on_shardwise.py"


def test_the_trainer_example_runs_on_two_ranks_as_on_accelerate(tmp_path):
    """The Trainer script with one import changed: the same final numbers as on Accelerate;
    resumed from its own last checkpoint it evaluates the same model."""
    pytest.importorskip("transformers")

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(TRAINER),
               *args]
        out = run(cmd)[0]
        return re.findall(r"final: eval_loss (\S+) accuracy (\S+) step (\d+) on 2 process\(es\) "
                          r"with (\w+)", out)[0]

    ours = torchrun("--output-dir", str(tmp_path / "a"))
    theirs = torchrun("--output-dir", str(tmp_path / "b"), "--accelerate")
    assert ours[3] == "ShardwiseAccelerator" and theirs[3] == "Accelerator"
    assert abs(float(ours[0]) - float(theirs[0])) < 1e-5 and ours[1:3] == theirs[1:3]
    assert float(ours[1]) > 0.5  # it learned to count
    # run again on the same output_dir: the Trainer resumes from its last checkpoint (the
    # end), trains nothing more and evaluates the same model
    again = torchrun("--output-dir", str(tmp_path / "a"), "--resume")
    assert again[2] == ours[2] and abs(float(again[0]) - float(ours[0])) < 1e-6
