# `shardwise env`: print what detect() sees here.
"""The ``env`` subcommand."""

from __future__ import annotations

import argparse

import attrs

HELP = "print the environment shardwise detects (ranks, device, backend, precisions)"


def register(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    """Versions, devices, each field of ``sw.detect()`` and the config in effect."""
    import platform

    import torch

    from shardwise import __version__
    from shardwise.cli.launch import default_config_path
    from shardwise.env import detect

    print(f"{'shardwise':<20} {__version__}")
    print(f"{'python':<20} {platform.python_version()} ({platform.platform()})")
    print(f"{'torch':<20} {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    for name in ("tensordict", "attrs", "safetensors", "transformers", "accelerate"):
        try:
            from importlib.metadata import version

            print(f"{name:<20} {version(name)}")
        except Exception:
            print(f"{name:<20} not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"{'cuda:' + str(i):<20} {torch.cuda.get_device_name(i)}")
    env = detect()
    for field in attrs.fields(type(env)):
        print(f"{field.name:<20} {getattr(env, field.name)}")
    launch_default = default_config_path()
    print(f"{'config in effect':<20} {env.config_path or 'none'}")
    print(f"{'launch default':<20} {launch_default}"
          f"{'' if launch_default.is_file() else ' (not written yet)'}")
    shown = env.config_path or (launch_default if launch_default.is_file() else None)
    if shown:
        print(open(shown).read().rstrip())
    return 0
