# The `shardwise` command.
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
import yaml

import shardwise as sw
from shardwise.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"shardwise {sw.__version__}"
    assert sw.__version__ == version("shardwise")


def cli(*argv, stdin="", **env):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *argv], capture_output=True,
                          text=True, check=True, input=stdin,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent",
                               **env}).stdout


def test_env_subcommand_prints_versions_fields_and_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_CPU\n")
    out = cli("env", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", SHARDWISE_CONFIG_FILE=str(config))
    assert "world_size           2" in out and "launcher             env" in out
    assert f"shardwise            {sw.__version__}" in out
    assert f"torch                {torch.__version__}" in out
    assert f"config in effect     {config}" in out and "distributed_type: MULTI_CPU" in out


def test_config_default_writes_a_file_from_config_reads(tmp_path):
    out = cli("config", "default", SHARDWISE_CONFIG_DIR=str(tmp_path))
    path = tmp_path / "default_config.yaml"
    assert f"configuration saved at {path}" in out
    data = yaml.safe_load(path.read_text())
    assert data["distributed_type"] == "MULTI_CPU" and data["num_processes"] == 2
    assert sw.replicate() in sw.from_config(path, env=sw.Env()).transforms


def test_config_asks_questions_on_stdin(tmp_path):
    path = tmp_path / "fsdp.yaml"
    answers = "FSDP\n4\nbf16\nTinyDecoderBlock\nno\nyes\n\n"
    cli("config", "--config_file", str(path), stdin=answers)
    data = yaml.safe_load(path.read_text())
    assert data["num_processes"] == 4 and data["mixed_precision"] == "bf16"
    assert data["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert data["fsdp_config"]["fsdp_cpu_offload"] is True
    env = sw.Env(world_size=4, local_world_size=4)
    pipe = sw.from_config(path, env=env)
    assert sw.shard(sw.by_class("TinyDecoderBlock"), reshard_after_forward=False) in \
        pipe.transforms and sw.offload() in pipe.transforms


def test_estimate_memory_for_a_factory_and_a_transformers_config(tmp_path):
    out = cli("estimate-memory", "shardwise.testing:TinyTransformerLM", "--world_sizes", "1,2",
              "--precisions", "fp32")
    assert "TinyTransformerLM: 0.0M parameters" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert len(rows) == 10 and rows[0][:3] == ["1", "fp32", "replicate"]
    two_shard = next(r for r in rows if r[:3] == ["2", "fp32", "shard"] and r[3] != "+")
    one = rows[0]
    assert float(two_shard[-1]) <= float(one[-1])
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, '
                      '"intermediate_size": 128, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "num_key_value_heads": 4}')
    out = cli("estimate-memory", str(config), "--world_sizes", "4", "--seq_len", "64")
    assert out.startswith("LlamaForCausalLM: 0.2M parameters")
    assert "n/a" not in out  # activations measured on the meta device


def test_written_configs_are_read_by_accelerate(tmp_path):
    loader = pytest.importorskip("accelerate.commands.config.config_args")
    cli("config", "default", SHARDWISE_CONFIG_DIR=str(tmp_path))
    plain = loader.load_config_from_file(str(tmp_path / "default_config.yaml"))
    assert str(plain.distributed_type).endswith("MULTI_CPU") and plain.num_processes == 2
    path = tmp_path / "fsdp.yaml"
    cli("config", "--config_file", str(path), stdin="FSDP\n2\nbf16\nTinyDecoderBlock\n\n\n\n")
    fsdp = loader.load_config_from_file(str(path))
    assert str(fsdp.distributed_type).endswith("FSDP") and str(fsdp.mixed_precision) == "bf16"
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "TinyDecoderBlock"
