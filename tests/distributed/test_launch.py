# `shardwise launch`: torchrun underneath, config handed to the script, flags over the file.
# Its tests that start no process are in tests/unit/test_launch_arguments.py.
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from _jobs import run_jobs

ROOT = Path(__file__).resolve().parents[2]


# no stray default_config.yaml of the machine's user may leak into the tests
ISOLATED = {"OMP_NUM_THREADS": "1", "SHARDWISE_CONFIG_DIR": "/nonexistent/shardwise-tests"}


def launch(*argv, cwd=ROOT):
    env = {**os.environ, **ISOLATED}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", *argv]
    [(code, out, err)] = run_jobs([cmd], env=env, cwd=cwd)
    return subprocess.CompletedProcess(cmd, code, out, err)


def test_launch_runs_the_example_on_two_processes():
    proc = launch("--num_processes", "2", "examples/train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "DistributedDataParallel over 2 ranks" in proc.stdout
    assert "done: 16 optimizer steps on 2 process(es)" in proc.stdout


def test_launch_hands_its_config_to_the_script(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "no",
        "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "TinyDecoderBlock"}}))
    proc = launch("--config_file", str(config), "examples/train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "shard(policy=by_class('TinyDecoderBlock')" in proc.stdout
    assert f"[from config {config}]" in proc.stdout
    assert "on 2 process(es)" in proc.stdout


def test_a_failing_script_fails_the_launch_with_its_own_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = launch("--num_processes", "2", str(script))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "shardwise launch: rank 1 failed first (exit code 3)" in proc.stderr


TWO_NODE_SCRIPT = """
import torch, shardwise as sw
from torch.utils.data import DataLoader
from shardwise.testing import SyntheticTokens, TinyTransformerLM
torch.manual_seed(0)
model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
loader = DataLoader(SyntheticTokens(size=64, seq_len=8), batch_size=4, shuffle=True)
env = sw.detect()
bundle = sw.pipeline(env)(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
state = bundle.init()
for batch in bundle.loader:
    state, out = bundle.step(state, batch)
total = sum(float(p.detach().double().sum()) for p in bundle.model.parameters())
print(f"RANK {env.rank} NODE {env.node_rank} OF {env.num_nodes} STEPS {state.step} SUM {total!r}")
"""


def test_two_machines_on_loopback_with_c10d_end_with_identical_parameters(tmp_path):
    from shardwise.testing import free_port

    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODE_SCRIPT)
    port = free_port()
    env = {**os.environ, **ISOLATED}
    results = run_jobs([
        [sys.executable, "-m", "shardwise.cli", "launch", "--num_machines", "2",
         "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), "--rdzv_backend", "c10d", str(script)]
        for rank in (0, 1)], env=env, cwd=ROOT)
    assert [code for code, _, _ in results] == [0, 0], results
    lines = sorted(line for _, out, _ in results for line in out.splitlines()
                   if line.startswith("RANK"))
    assert len(lines) == 2
    assert {line.split(" SUM ")[1] for line in lines} == {lines[0].split(" SUM ")[1]}
    assert all("OF 2 STEPS 8" in line for line in lines)
    assert {line.split(" NODE ")[1][0] for line in lines} == {"0", "1"}


def test_launch_errors_are_one_line_and_exit_2(tmp_path):
    proc = launch("--config_file", str(tmp_path / "missing.yaml"), "t.py")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("shardwise launch: --config_file")
    assert "Traceback" not in proc.stderr


def test_only_the_known_teardown_abort_is_run_once_more(tmp_path):
    from _jobs import TEARDOWN_ABORT

    marker = tmp_path / "first-run-done"
    flaky = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
             f"if not m.exists(): m.touch(); sys.stderr.write({TEARDOWN_ABORT!r}); sys.exit(134)\n"
             "print('second run')")
    [(code, out, _)] = run_jobs([[sys.executable, "-c", flaky]], timeout=60)
    assert (code, out.strip()) == (0, "second run")
    always = f"import sys; sys.stderr.write({TEARDOWN_ABORT!r}); sys.exit(134)"
    assert run_jobs([[sys.executable, "-c", always]], timeout=60)[0][0] == 134
    # any other failure is not rerun, and stops the other machines at once
    start = time.monotonic()
    results = run_jobs([[sys.executable, "-c", "import sys; sys.exit(3)"],
                        [sys.executable, "-c", "import time; time.sleep(60)"]], timeout=120)
    assert [code for code, _, _ in results] == [3, -9] and time.monotonic() - start < 30


def test_accelerate_launch_flags_are_accepted_and_reach_the_script(tmp_path):
    script = tmp_path / "show.py"
    # one write per line: the ranks share the pipe, and print() writes its pieces apart
    script.write_text("import os, sys, shardwise as sw\n"
                      "sys.stdout.write(f\"visible {os.environ.get('CUDA_VISIBLE_DEVICES')!r}\\n\")\n"
                      "env = sw.detect()\n"
                      "if env.rank == 0:\n"
                      "    print(sw.pipeline(env).explain())\n")
    proc = launch("--cpu", "--num_processes", "2", "--mixed_precision", "no",
                  "--dynamo_backend", "inductor", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("visible ''") == 2  # --cpu hides any GPU from the ranks
    assert "mixed_precision(precision='fp32')  [from config" in proc.stdout
    # --dynamo_backend compiles the whole model, as accelerate launch does
    assert "compile(policy=auto(), mode=None, dynamic=None, fullgraph=False, backend='inductor', " \
        "regional=False)  [from config" in proc.stdout
