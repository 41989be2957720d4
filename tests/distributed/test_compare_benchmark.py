# benchmarks/compare.py end to end on one row: it runs and its JSON holds what the table shows.
"""``benchmarks/compare.py --quick`` on the DDP row only, 1 round of 2 batches, in a subprocess
(2 forked gloo ranks per job). No timing assertions: only that every implementation ran,
trained the same thing, and gave positive figures."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"


def test_quick_compare_writes_the_rows_it_ran(tmp_path):
    out = tmp_path / "compare.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rows", "ddp", "--rounds", "1",
                           "--steps", "2", "--json", str(out), "--timeout", "120"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["rows"]) == ["ddp"]
    row = result["rows"]["ddp"]
    impls = ["hand-written", "shardwise"]
    if importlib.util.find_spec("accelerate"):
        impls.append("accelerate")
    assert [i for i in ("hand-written", "shardwise", "accelerate") if i in row] == impls
    assert row["settings"]["rounds"] == 1 and row["settings"]["batches_per_block"] == 2
    for impl in impls:
        entry = row[impl]
        assert entry["error"] is None
        for key in ("ms_per_batch", "first_step_s", "peak_rss_mib"):
            assert entry[key]["median"] > 0, (impl, key, entry[key])
        assert entry["ratio_to_hand"]["median"] > 0
        assert result["import_ms"][impl]["median"] > 0
    if "accelerate" in impls:
        assert row["shardwise"]["ratio_to_accelerate"]["median"] > 0
    # same model, data and optimizer: the three train alike
    assert row["loss_spread"] < 1e-4
    assert "| ddp | shardwise |" in done.stdout


def test_the_gpu_throughput_script_runs_its_cpu_parts():
    """benchmarks/gpu_throughput.py's rows on a tiny Llama on the CPU (the GPU run needs a
    device): each row trains and reports tokens/s; no MFU without a known peak."""
    script = SCRIPT.parent / "gpu_throughput.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--steps", "1",
                           "--warmup", "1", "--rows", "hand-written", "shardwise", "accelerate"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "tokens/s" in line]
    assert [line.split()[0] for line in lines] == ["hand-written", "shardwise", "accelerate"]
    assert all(float(line.split()[1]) > 0 and "MFU     -" in line for line in lines)
