# torchrun, run as `python -m shardwise.cli._torchrun ARGS`: the script's exit code comes back.
"""torchrun's own ``run`` with two changes at the end of a failed job: the rank that failed
first is named in one line, and the job's exit code is that rank's own (a signal N gives
128 + N, as a shell does), not torchrun's 1."""

from __future__ import annotations

import signal
import sys

__all__ = ["main", "exit_code"]


def exit_code(code: int) -> int:
    """A process's exit status as a shell reports it: a signal N gives 128 + N."""
    return 128 - code if code < 0 else code


def _signal_name(code: int) -> str:
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; returns 0, or the exit code of the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        print(str(failed), file=sys.stderr)
        rank, failure = failed.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        lines = str(message).strip().splitlines()
        said = lines[-1][:500] if lines and not lines[-1].startswith("To enable traceback") \
            else ""
        code = failure.exitcode
        print(f"shardwise launch: rank {rank} failed first (exit code {code}"
              f"{_signal_name(code) if code < 0 else ''}){': ' + said if said else ''}",
              file=sys.stderr)
        return exit_code(code) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
