# The `shardwise` command: a short dispatcher, one module per subcommand.
"""``shardwise [--version] <command> ...``."""

from __future__ import annotations

import argparse
import sys

from shardwise.cli import config as config_command
from shardwise.cli import env as env_command
from shardwise.cli import estimate_memory as estimate_command
from shardwise.cli import from_hf as from_hf_command
from shardwise.cli import launch as launch_command
from shardwise.cli import lighthouse as lighthouse_command
from shardwise.cli import to_hf as to_hf_command

__all__ = ["main"]

_COMMANDS = {"config": config_command, "env": env_command, "estimate-memory": estimate_command,
             "from-hf": from_hf_command, "launch": launch_command, "lighthouse": lighthouse_command,
             "to-hf": to_hf_command}


def main(argv: list[str] | None = None) -> int:
    """Run the ``shardwise`` command line; returns the exit code."""
    from shardwise import __version__

    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name, module in _COMMANDS.items():
        module.register(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from shardwise.errors import ShardwiseError

    try:
        return int(_COMMANDS[args.command].run(args))
    except ShardwiseError as exc:
        print(f"shardwise {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
