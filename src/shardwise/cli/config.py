# `shardwise config`: write an Accelerate-format default_config.yaml, by questions or defaults.
"""The ``config`` subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HELP = "write default_config.yaml (Accelerate's format) by a few questions; 'default' asks none"


def register(parser: argparse.ArgumentParser) -> None:
    """``[default] [--config_file PATH]``."""
    parser.add_argument("mode", nargs="?", choices=["default"],
                        help="write the defaults without asking")
    parser.add_argument("--config_file", help="where to write (default: $SHARDWISE_CONFIG_DIR "
                        "or ~/.cache/shardwise/, file default_config.yaml)")


def _defaults() -> dict[str, Any]:
    import torch

    gpus = torch.cuda.device_count()
    return {"compute_environment": "LOCAL_MACHINE", "debug": False,
            "distributed_type": "MULTI_GPU" if gpus > 1 else "MULTI_CPU" if not gpus else "NO",
            "mixed_precision": "bf16" if gpus and torch.cuda.is_bf16_supported() else "no",
            "num_machines": 1, "machine_rank": 0, "num_processes": max(gpus, 2) if gpus != 1
            else 1, "rdzv_backend": "static", "same_network": True, "use_cpu": not gpus,
            "main_training_function": "main"}


def _ask(question: str, default: Any, choices: list[str] | None = None) -> str:
    shown = f" [{'/'.join(choices)}]" if choices else ""
    while True:
        try:
            answer = input(f"{question}{shown} ({default}): ").strip()
        except EOFError:
            answer = ""
        if not answer:
            return str(default)
        if choices is None or answer in choices:
            return answer
        print(f"please answer one of {', '.join(choices)}")


def _ask_count(question: str, default: int) -> int:
    """An integer >= 1, asked again until one is given."""
    while True:
        answer = _ask(question, default)
        if answer.isdigit() and int(answer) >= 1:
            return int(answer)
        print("please answer an integer >= 1")


def _yes(question: str, default: str) -> bool:
    """A yes/no question's answer."""
    return _ask(question, default, ["yes", "no", "y", "n"]) in ("yes", "y")


def _interactive(config: dict[str, Any]) -> dict[str, Any]:
    config["distributed_type"] = _ask("How to distribute?", config["distributed_type"],
                                      ["NO", "MULTI_CPU", "MULTI_GPU", "FSDP"])
    config["num_processes"] = _ask_count("How many processes in total?", config["num_processes"])
    config["mixed_precision"] = _ask("Mixed precision?", config["mixed_precision"],
                                     ["no", "bf16", "fp16"])
    if config["distributed_type"] == "FSDP":
        layer = _ask("Transformer block class to shard (empty: found automatically)?", "")
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": _yes("Reshard after forward?", "yes"),
            "fsdp_cpu_offload": _yes("Offload parameters to the CPU?", "no"),
            "fsdp_activation_checkpointing": _yes("Activation checkpointing?", "no"),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
        if layer:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = layer
        config["fsdp_config"] = fsdp
    return config


def run(args: argparse.Namespace) -> int:
    """Write the file and say where."""
    import yaml

    from shardwise.cli.launch import default_config_path
    from shardwise.configured import from_config
    from shardwise.env import Env
    from shardwise.errors import ConfigError

    config = _defaults()
    if args.mode != "default":
        config = _interactive(config)
    path = Path(args.config_file) if args.config_file else default_config_path()
    # refuse to write what cannot be read back (on whatever device it will run)
    from_config(config, env=Env(precisions=("fp32", "bf16", "fp16")))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"configuration saved at {path}")
    return 0
