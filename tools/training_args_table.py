# Writes (or checks) the table of docs/training-args.md from the TrainingArguments field table.
"""The docs table of every ``TrainingArguments`` field and what it becomes, generated from
``shardwise.configs.training_args_fields.ARGUMENTS`` (the table the reader itself uses).

    .venv/bin/python tools/training_args_table.py           # rewrite the table in the page
    .venv/bin/python tools/training_args_table.py --check   # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training-args.md"
HEADER = "| argument | what it becomes here |"
ROW = re.compile(r"^\| `([a-z0-9_]+)` \| (.+) \|$")


def table() -> str:
    """The table: every argument and what it becomes."""
    from shardwise.configs.training_args_fields import ARGUMENTS

    rows = [f"| `{name}` | {meaning} |" for name, meaning in ARGUMENTS.items()]
    return "\n".join([HEADER, "|---|---|", *rows])


def rewritten(text: str) -> str:
    """``text`` (the page) with its table replaced by :func:`table`."""
    lines = text.splitlines()
    start = lines.index(HEADER)
    end = start + 2
    while end < len(lines) and ROW.match(lines[end]):
        end += 1
    return "\n".join([*lines[:start], table(), *lines[end:]]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    text = PAGE.read_text()
    if args.check:
        if rewritten(text) != text:
            print(f"{PAGE} is out of date; run `.venv/bin/python tools/training_args_table.py`")
            return 1
        return 0
    PAGE.write_text(rewritten(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
