# `shardwise launch`: torchrun underneath, config handed to the script, flags over the file.
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardwise.cli.launch import default_config_path, register, torchrun_args
from shardwise.errors import ConfigError

from _jobs import run_jobs

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(argv)


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


def test_torchrun_arguments_for_one_and_several_machines():
    args = torchrun_args({"num_processes": 4}, parse("train.py", "--lr", "1"))
    assert args[:3] == ["--nproc_per_node=4", "--max_restarts=0", "--nnodes=1"]
    assert args[-3:] == ["train.py", "--lr", "1"]
    assert int(next(a for a in args if a.startswith("--master_port=")).split("=")[1]) > 0
    c10d = torchrun_args({"num_processes": 4, "num_machines": 2, "rdzv_backend": "c10d",
                          "main_process_ip": "10.1.2.3", "main_process_port": 29400},
                         parse("-m", "pkg.train"))
    assert "--nproc_per_node=2" in c10d and "--rdzv_endpoint=10.1.2.3:29400" in c10d
    assert not any(a.startswith("--rdzv_conf") for a in c10d)  # no machine_rank: torch decides
    hosts = [torchrun_args({"num_processes": 2, "num_machines": 2, "rdzv_backend": "c10d",
                            "machine_rank": rank}, parse("t.py")) for rank in (0, 1)]
    assert "--rdzv_conf=is_host=1" in hosts[0] and "--rdzv_conf=is_host=0" in hosts[1]
    assert c10d[-2:] == ["-m", "pkg.train"]
    static = torchrun_args({"num_processes": 2, "num_machines": 2, "machine_rank": 1,
                            "main_process_ip": "h0", "main_process_port": 1234},
                           parse("t.py"))
    assert {"--node_rank=1", "--master_addr=h0", "--master_port=1234"} <= set(static)


@pytest.mark.parametrize("settings, message", [
    ({"num_processes": 3, "num_machines": 2}, "num_processes=3 must be a positive multiple"),
    ({"num_processes": 2, "num_machines": 2}, "needs main_process_ip and machine_rank"),
])
def test_impossible_launch_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        torchrun_args(settings, parse("t.py"))


def test_the_default_config_place(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDWISE_CONFIG_DIR", str(tmp_path))
    assert default_config_path() == tmp_path / "default_config.yaml"
    monkeypatch.delenv("SHARDWISE_CONFIG_DIR")
    assert default_config_path() == Path.home() / ".cache" / "shardwise" / "default_config.yaml"


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


def test_machines_agree_on_a_port_and_null_values_count_as_unset():
    args = torchrun_args({"num_processes": 2, "num_machines": 2, "rdzv_backend": "c10d",
                          "main_process_ip": None, "main_process_port": None}, parse("t.py"))
    assert "--rdzv_endpoint=127.0.0.1:29500" in args
    with pytest.raises(ConfigError, match="main_process_port=0 .a free port. works on one "
                                          "machine only"):
        torchrun_args({"num_processes": 2, "num_machines": 2, "main_process_port": 0,
                       "rdzv_backend": "c10d"}, parse("t.py"))
    with pytest.raises(ConfigError, match="num_processes='two' is not accepted"):
        torchrun_args({"num_processes": "two"}, parse("t.py"))
    assert "--nproc_per_node=1" in torchrun_args({"num_processes": None}, parse("t.py"))


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
    script.write_text("import os, shardwise as sw\n"
                      "print('visible', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n"
                      "print(sw.pipeline(sw.detect()).explain())\n")
    proc = launch("--cpu", "--num_processes", "2", "--mixed_precision", "no",
                  "--dynamo_backend", "inductor", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("visible ''") == 2  # --cpu hides any GPU from the ranks
    assert "mixed_precision(precision='fp32')  [from config" in proc.stdout
    # --dynamo_backend compiles the whole model, as accelerate launch does
    assert "compile(policy=auto(), mode=None, dynamic=None, fullgraph=False, backend='inductor', " \
        "regional=False)  [from config" in proc.stdout


def test_accelerate_flags_parse_and_unknown_flags_are_still_errors(capsys):
    args = parse("--cpu", "--multi_gpu", "--mixed_precision", "bf16", "t.py", "--cpu")
    assert args.cpu and args.multi_gpu and args.script_args == ["--cpu"]  # the script's own
    with pytest.raises(SystemExit) as exit_:
        parse("--tpu", "t.py")
    assert exit_.value.code == 2 and "unrecognized arguments: --tpu" in capsys.readouterr().err


def test_no_is_accelerates_name_for_full_precision():
    import shardwise as sw

    assert sw.mixed_precision("no") == sw.mixed_precision("fp32")
