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


def _write(path, content):
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize("argv, files, names", [
    (["launch", "--config_file", "{bad.yaml}", "t.py"], {"bad.yaml": "a: [1, 2\n"},
     "is not valid YAML"),
    (["launch", "--config_file", "{latin.yaml}", "t.py"], {"latin.yaml": b"num_processes: 2 # \xe9\n"},
     "is not UTF-8"),
    (["launch", "--config_file", "{.}", "t.py"], {}, "not a file"),
    (["launch", "--main_process_port", "99999", "t.py"], {}, "main_process_port=99999"),
    (["launch", "--max_restarts", "-1", "t.py"], {}, "--max_restarts -1"),
    (["launch", "--config_file", "{c.yaml}", "t.py"], {"c.yaml": "num_processes: 2.5\n"},
     "num_processes=2.5"),
    (["launch", "--config_file", "{c.yaml}", "t.py"], {"c.yaml": "num_processes: -3\n"},
     "num_processes=-3"),
    (["launch", "--config_file", "{c.yaml}", "t.py"], {"c.yaml": "num_processes: true\n"},
     "num_processes=True"),
    (["launch", "--config_file", "{c.yaml}", "t.py"], {"c.yaml": "gpu_ids: [0, x]\n"},
     "gpu_ids="),
    (["launch", "--config_file", "{c.yaml}", "t.py"], {"c.yaml": "rdzv_backend: etcd\n"},
     "rdzv_backend='etcd'"),
    (["estimate-memory", "{c.json}"], {"c.json": "[1, 2]"}, "must hold a mapping"),
    (["estimate-memory", "{c.json}"], {"c.json": "{\"model_type\": 3}"}, "model_type=3"),
    (["estimate-memory", "{c.json}"], {"c.json": "{\"model_type\": \"llama\", \"hidden_size\": \"x\"}"},
     "cannot build a causal LM"),
    (["estimate-memory", "{c.json}"], {"c.json": "{\"a\": 1, \"a\": 2}"}, "'a'"),
    (["estimate-memory", "{c.json}"], {"c.json": b"\xff\xfe"}, "is not UTF-8"),
    (["estimate-memory", "no.such.module:build"], {}, "cannot import 'build'"),
    (["estimate-memory", "shardwise.testing:TinyMLP", "--world_sizes", "2,x"], {}, "--world_sizes"),
    (["estimate-memory", "shardwise.testing:TinyMLP", "--precisions", "fp8"], {}, "--precisions"),
    (["estimate-memory", "shardwise.testing:TinyMLP", "--batch_size", "0"], {}, "--batch_size 0"),
    (["config", "default", "--config_file", "{.}"], {}, "cannot write"),
])
def test_bad_command_line_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, files,
                                                       names):
    monkeypatch.setenv("SHARDWISE_CONFIG_DIR", str(tmp_path / "none"))
    for name, content in files.items():
        _write(tmp_path / name, content)
    argv = [str(tmp_path / a[1:-1]) if a.startswith("{") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise {argv[0]}: ") and "\n" not in err, err
    assert names in err, err


def test_config_asks_again_until_the_answer_is_a_count(tmp_path):
    path = tmp_path / "c.yaml"
    cli("config", "--config_file", str(path), stdin="MULTI_CPU\nabc\n-3\n2.5\n3\nno\n")
    assert yaml.safe_load(path.read_text())["num_processes"] == 3


def test_gpu_ids_become_a_cuda_visible_devices_list():
    from shardwise.cli.launch import visible_devices

    assert visible_devices([0, 1]) == "0,1" and visible_devices("2, 3") == "2,3"
    assert visible_devices(1) == "1"
    with pytest.raises(sw.errors.ConfigError, match="gpu_ids="):
        visible_devices(True)
