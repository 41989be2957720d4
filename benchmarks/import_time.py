# What `import shardwise` adds to `import torch`, beside `import accelerate`, and the CLI's start.
"""Import and start-up times, each in fresh interpreters, in alternating rounds.

Each round runs every case once in a new process, in turn, so machine noise falls on all
alike; the table gives the median over the rounds and the spread (max - min) / median.
"What it adds" is the import measured inside the process after ``import torch`` (so
Python's and torch's own start-up are not counted); the CLI rows are whole processes.

    python benchmarks/import_time.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ADDED = ("import time, torch; t = time.perf_counter(); import {name}; "
         "print(time.perf_counter() - t)")
CASES = {
    "import shardwise (after torch)": [sys.executable, "-c", ADDED.format(name="shardwise")],
    "import accelerate (after torch)": [sys.executable, "-c", ADDED.format(name="accelerate")],
}
WHOLE = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "shardwise --help": [str(BIN / "shardwise"), "--help"],
    "shardwise env": [str(BIN / "shardwise"), "env"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    samples: dict[str, list[float]] = {name: [] for name in (*CASES, *WHOLE)}
    for _ in range(rounds):
        for name, cmd in CASES.items():
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            samples[name].append(float(out.strip().splitlines()[-1]))
        for name, cmd in WHOLE.items():
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            samples[name].append(time.perf_counter() - start)
    print(f"median of {rounds} alternating rounds, fresh processes")
    print(f"  {'case':<34}{'ms':>8}{'spread':>9}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"  {name:<34}{median * 1e3:>8.1f}{(max(values) - min(values)) / median:>8.0%}")
    ours = statistics.median(samples["import shardwise (after torch)"])
    theirs = statistics.median(samples["import accelerate (after torch)"])
    print(f"  shardwise / accelerate import: {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
