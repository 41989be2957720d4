# `shardwise launch`: run a script on torchrun with settings from an Accelerate-style config.
"""The ``launch`` subcommand: ``torch.distributed.run`` with mapped arguments."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from shardwise._net import free_port
from shardwise._text import short

HELP = "run a training script on torchrun (config file and flags like `accelerate launch`)"

_LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip",
                "main_process_port", "rdzv_backend", "mixed_precision")


# the launch flags that change what the script builds (the rest only shape the launch)
_SCRIPT_KEYS = {"mixed_precision", "use_cpu", "distributed_type", "dynamo_config"}


def default_config_path() -> Path:
    """Where `shardwise config` writes and `launch` looks: $SHARDWISE_CONFIG_DIR, else
    ~/.cache/shardwise/, file default_config.yaml."""
    base = os.environ.get("SHARDWISE_CONFIG_DIR") or Path.home() / ".cache" / "shardwise"
    return Path(base) / "default_config.yaml"


def register(parser: argparse.ArgumentParser) -> None:
    """Accelerate's launch flags, then the script and its arguments."""
    parser.add_argument("--config_file", help="an Accelerate/shardwise YAML (default: "
                        "$SHARDWISE_CONFIG_DIR or ~/.cache/shardwise/default_config.yaml)")
    parser.add_argument("--num_processes", type=int, help="processes in total, all machines")
    parser.add_argument("--num_machines", type=int)
    parser.add_argument("--machine_rank", type=int)
    parser.add_argument("--main_process_ip")
    parser.add_argument("--main_process_port", type=int, help="0 picks a free port")
    parser.add_argument("--rdzv_backend", choices=["static", "c10d"])
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU even where GPUs are visible (use_cpu: true)")
    parser.add_argument("--multi_gpu", action="store_true",
                        help="one process per GPU, replicated (distributed_type: MULTI_GPU)")
    parser.add_argument("--dynamo_backend", help="compile the model with this torch.compile "
                        "backend (dynamo_config.dynamo_backend: sw.compile(backend=..., "
                        "regional=False), as Accelerate compiles the whole model)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the script as a module, like python -m")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


def _settings(args: argparse.Namespace) -> tuple[dict[str, Any], Path | None, bool]:
    """The config file's settings with the command line's on top, the file read, and whether
    the script must be handed these settings (the flags changed what it would read)."""
    from shardwise._config_source import load_source
    from shardwise.errors import ConfigError

    if args.max_restarts < 0:
        raise ConfigError(f"--max_restarts {args.max_restarts} is not accepted; accepted: an "
                          "integer >= 0")
    path: Path | None = Path(args.config_file) if args.config_file else default_config_path()
    assert path is not None
    data: dict[str, Any] = {}
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"--config_file {path}: not a file")
        data = dict(load_source(path).data)  # bounded, UTF-8, no aliases or repeated keys
    elif args.config_file:
        raise ConfigError(f"--config_file {path}: no such file")
    else:
        path = None
    flags = {key: getattr(args, key) for key in _LAUNCH_KEYS if getattr(args, key) is not None}
    if args.cpu:
        flags["use_cpu"] = True
    if args.multi_gpu:
        flags["distributed_type"] = "MULTI_GPU"
    if args.dynamo_backend not in (None, "no", "NO"):
        flags["dynamo_config"] = {**data.get("dynamo_config", {}),
                                  "dynamo_backend": args.dynamo_backend}
    # only a flag that changes what the script reads makes a new config worth handing over
    # (the file itself is handed over as it is)
    for_script = any(data.get(key) != value for key, value in flags.items()
                     if key in _SCRIPT_KEYS)
    return {**data, **flags}, path, for_script


def _integer(settings: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    """``settings[key]`` if it is an integer in [low, high] (a digit string too), else a
    ConfigError naming it."""
    from shardwise.errors import ConfigError

    value = settings.get(key)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{key}={short(value)} is not accepted; accepted: an integer in "
                          f"[{low}, {high}]")
    return value


def visible_devices(value: Any) -> str:
    """``gpu_ids`` (``all``, an index, a list of them or ``"0,1"``) as CUDA_VISIBLE_DEVICES."""
    from shardwise.errors import ConfigError

    items = value if isinstance(value, list) else str(value).split(",")
    text = [str(item).strip() for item in items]
    if isinstance(value, bool) or not text or not all(t.isdigit() for t in text):
        raise ConfigError(f"gpu_ids={short(value)} is not accepted; accepted: 'all', a "
                          "device index, a list of them, or a comma-separated string '0,1'")
    return ",".join(text)


def torchrun_args(settings: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for these settings."""
    from shardwise.errors import ConfigError

    machines = _integer(settings, "num_machines", 1, 1, 2**16)
    total = _integer(settings, "num_processes", 1, 1, 2**20)
    if total < machines or total % machines:
        raise ConfigError(f"num_processes={total} must be a positive multiple of "
                          f"num_machines={machines} (processes are spread evenly)")
    machine_rank = _integer(settings, "machine_rank", 0, 0, machines - 1)
    port = _integer(settings, "main_process_port", 0 if machines == 1 else 29500, 0, 65535)
    if port == 0:
        if machines > 1:
            raise ConfigError("main_process_port=0 (a free port) works on one machine only: "
                              "the machines must agree on the port; give one, or leave it "
                              "unset for 29500")
        port = free_port()
    ip = settings.get("main_process_ip") or None
    if ip is not None and not isinstance(ip, str):
        raise ConfigError(f"main_process_ip={short(ip)} is not accepted; accepted: a host "
                          "name or address")
    backend = settings.get("rdzv_backend") or "static"
    if backend not in ("static", "c10d"):
        raise ConfigError(f"rdzv_backend={short(backend)} is not accepted; accepted: "
                          "'static' or 'c10d'")
    out = [f"--nproc_per_node={total // machines}", f"--max_restarts={args.max_restarts}"]
    if machines == 1 and backend == "static":
        out += ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
    elif backend == "c10d":
        ip = ip or "127.0.0.1"
        out += [f"--nnodes={machines}", "--rdzv_backend=c10d", f"--rdzv_endpoint={ip}:{port}",
                "--rdzv_id=shardwise"]
        if settings.get("machine_rank") is not None:
            # machine 0 hosts the rendezvous store; without this every machine whose address
            # matches the endpoint (all of them on loopback) races to host it
            out.append(f"--rdzv_conf=is_host={int(machine_rank == 0)}")
    else:
        if ip is None or settings.get("machine_rank") is None:
            raise ConfigError("a static launch on several machines needs main_process_ip and "
                              "machine_rank (or use --rdzv_backend c10d)")
        out += [f"--nnodes={machines}", f"--node_rank={machine_rank}",
                f"--master_addr={ip}", f"--master_port={port}"]
    if args.module:
        out.append("-m")
    return [*out, args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """Start the job; returns 0, or the exit code of the rank that failed first."""
    import yaml

    from shardwise.env import CONFIG_ENV_VAR

    settings, path, changed = _settings(args)
    command = [sys.executable, "-m", "shardwise.cli._torchrun", *torchrun_args(settings, args)]
    child_env = dict(os.environ)
    if settings.get("use_cpu") is True:
        child_env["CUDA_VISIBLE_DEVICES"] = ""  # sw.detect() then picks the CPU
    elif settings.get("gpu_ids") not in (None, "all"):
        child_env["CUDA_VISIBLE_DEVICES"] = visible_devices(settings["gpu_ids"])
    handed = None
    if path is not None and not changed:
        child_env[CONFIG_ENV_VAR] = str(path.resolve())
    elif changed:  # the file's settings with the flags on top, or the flags alone
        # hand the settings in effect (file plus flags) to the script: sw.detect() reads them
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="shardwise-",
                                         delete=False) as stream:
            yaml.safe_dump({"distributed_type": "NO", **settings}, stream)
        handed = Path(stream.name)
        child_env[CONFIG_ENV_VAR] = str(handed)
    try:
        return subprocess.call(command, env=child_env)
    finally:
        if handed is not None:
            handed.unlink(missing_ok=True)
