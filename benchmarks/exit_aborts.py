# How often a 2-rank gloo DDP job dies while exiting, by how the script ends.
"""Run many small 2-process jobs (env:// set by hand, DDP via the default pipeline) and count
worker exits that are not 0, for two endings measured side by side, alternating:

- ``shardwise``: the script just ends; shardwise's exit barrier meets on the store.
- ``gloo-barrier``: the script ends with its own ``dist.barrier()`` (gloo work queued at
  exit, released by a gloo thread that may race interpreter finalization).

    OMP_NUM_THREADS=1 python benchmarks/exit_aborts.py --seconds 600

The abort is rare (about 1 exit in 300 with a gloo barrier on this machine), so give it
minutes; the script prints counts, not a verdict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.testing import free_port

WORKER = """
import sys, torch, torch.distributed as dist, shardwise as sw
from torch.utils.data import DataLoader
from shardwise.testing import SyntheticTokens, TinyTransformerLM
torch.manual_seed(0)
model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
loader = DataLoader(SyntheticTokens(size=64, seq_len=8), batch_size=4, shuffle=True)
bundle = sw.pipeline(sw.detect())(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
state = bundle.init()
for batch in bundle.loader:
    state, out = bundle.step(state, batch)
if sys.argv[1] == "gloo-barrier":
    dist.barrier()
"""


def job(script: Path, ending: str) -> list[tuple[int, str]]:
    """One 2-rank job; (exit code, last stderr line) of each rank."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script), ending], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}) for r in (0, 1)]
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        lines = err.strip().splitlines()
        results.append((p.returncode, lines[-1] if lines else ""))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300, help="how long to keep starting jobs")
    args = parser.parse_args()
    counts = {ending: [0, 0] for ending in ("shardwise", "gloo-barrier")}  # exits, failures
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for ending, count in counts.items():
                for code, last in job(script, ending):
                    count[0] += 1
                    if code != 0:
                        count[1] += 1
                        print(f"{ending}: exit code {code}: {last}", flush=True)
    for ending, (exits, failures) in counts.items():
        print(f"{ending:>13}: {failures} failed of {exits} worker exits")


if __name__ == "__main__":
    main()
