# Scripts started by `accelerate launch` follow its configuration, as under `shardwise launch`.
# Its tests that start no process are in tests/unit/test_accelerate_launch_variables.py.
import json
import os
import sys
from pathlib import Path

from shardwise.testing import free_port

from _jobs import run_jobs

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent


def test_the_llama_example_trains_the_same_under_accelerate_launch_and_shardwise_launch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "SHARDWISE_CONFIG_DIR": str(tmp_path / "none"), "HF_HOME": str(tmp_path / "hf")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    script = ["examples/llama_fsdp.py", "--steps", "4"]
    commands = {
        "shardwise": [str(BIN / "shardwise"), "launch", "--config_file", "examples/fsdp2.yaml",
                      "--main_process_port", str(free_port()), *script,
                      "--summary", str(tmp_path / "shardwise.json")],
        "accelerate": [str(BIN / "accelerate"), "launch", "--config_file", "examples/fsdp2.yaml",
                       "--main_process_port", str(free_port()), *script,
                       "--summary", str(tmp_path / "accelerate.json")]}
    results = run_jobs(list(commands.values()), env=env, cwd=ROOT, timeout=300)
    for (name, _), (code, out, err) in zip(commands.items(), results, strict=True):
        assert code == 0, f"{name} launch failed:\n{out}\n{err[-3000:]}"
        assert "2 process(es) (torchrun)" in out, name
    ours, theirs = (json.loads((tmp_path / f"{n}.json").read_text()) for n in commands)
    assert ours["transforms"][:2] == [
        "mixed_precision(precision='bf16')",
        "shard(policy=by_class('LlamaDecoderLayer'), reshard_after_forward=True, mesh=None, "
        "replicate_across_nodes=False, sync_each_batch=False)"]
    assert ours == theirs  # the same pipeline, losses and weights, bit for bit
    assert len(ours["losses"]) == 4

