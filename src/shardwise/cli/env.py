# `shardwise env`: print what detect() sees here.
"""The ``env`` subcommand."""

from __future__ import annotations

import argparse

import attrs

HELP = "print the environment shardwise detects (ranks, device, backend, precisions)"


def register(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    """Print each field of ``sw.detect()``."""
    from shardwise.env import detect

    env = detect()
    for field in attrs.fields(type(env)):
        print(f"{field.name:<20} {getattr(env, field.name)}")
    return 0
