# `shardwise launch` without launching: its flags, torchrun's arguments for one and more machines, refusals.
import argparse
from pathlib import Path

import pytest

from shardwise.cli.launch import default_config_path, register, torchrun_args
from shardwise.errors import ConfigError


def parse(*argv):
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(argv)


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


def test_accelerate_flags_parse_and_unknown_flags_are_still_errors(capsys):
    args = parse("--cpu", "--multi_gpu", "--mixed_precision", "bf16", "t.py", "--cpu")
    assert args.cpu and args.multi_gpu and args.script_args == ["--cpu"]  # the script's own
    with pytest.raises(SystemExit) as exit_:
        parse("--tpu", "t.py")
    assert exit_.value.code == 2 and "unrecognized arguments: --tpu" in capsys.readouterr().err


def test_no_is_accelerates_name_for_full_precision():
    import shardwise as sw

    assert sw.mixed_precision("no") == sw.mixed_precision("fp32")
