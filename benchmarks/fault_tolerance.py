# What losing a machine costs: torchrun's restart from a checkpoint beside torchft's replica groups.
"""One failure, two ways, on 2 CPU processes with the same model, data and step time:

- **restart**: one job of 2 ranks (``replicate()``) under ``torchrun --max-restarts=1``,
  ``sw.save`` every ``--every`` steps; rank 1 SIGKILLs itself in step ``--kill-at``. torchrun
  stops rank 0 and starts both again; they ``sw.load`` the newest checkpoint and redo the
  steps since it.
- **torchft**: two replica groups of 1 process (``sw.fault_tolerant()``) under ``shardwise
  lighthouse``; group 1 is SIGKILLed after step ``--kill-at`` and started again at once. Group
  0 goes on alone; group 1 heals from it when it is back.

Printed side by side: the steps computed again (or discarded), the time from the kill until
the job's progress moves past where it was (the restart: every rank; torchft: the survivor),
and the time until the killed process trains again. ``--pause`` stands for the compute of a
step (seconds), so the figures read as a model whose step takes that long.

    OMP_NUM_THREADS=1 python benchmarks/fault_tolerance.py [--kill-at 25] [--every 10]
        [--pause 0.05] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


def _bundle(sw, env, parts):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(8192, 32), torch.randn(8192, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    return sw.pipeline(env, *parts)(model, optimizer, loader, loss_fn=loss_fn)


def worker(mode: str, out: Path, args: argparse.Namespace) -> None:
    """One process of either scenario: trains, logs each step's end time, saves (restart)."""
    import shardwise as sw

    env = sw.detect()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    name = f"group{env.replica_group}" if mode == "torchft" else f"rank{env.rank}"
    parts = [sw.fault_tolerant(hostname="127.0.0.1")] if mode == "torchft" else [sw.replicate()]
    bundle = _bundle(sw, env, parts)
    ckpt = out / "ckpt"
    state = sw.load(ckpt, bundle) if mode == "restart" and sw.latest_checkpoint(ckpt) \
        else bundle.init()
    log = open(out / f"{name}.jsonl", "a")  # noqa: SIM115
    log.write(json.dumps({"event": "start", "time": time.time(), "step": state.step,
                          "attempt": attempt}) + "\n")
    log.flush()
    while state.step < args.steps:
        for batch in bundle.loader:
            if mode == "restart" and env.rank == 1 and attempt == 0 \
                    and state.step + 1 == args.kill_at:
                log.write(json.dumps({"event": "killed", "time": time.time()}) + "\n")
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            state, out_ = bundle.step(state, batch)
            time.sleep(args.pause)
            log.write(json.dumps({"event": "step", "time": time.time(), "step": state.step,
                                  "stepped": out_.stepped, "attempt": attempt}) + "\n")
            log.flush()
            if mode == "restart" and state.step % args.every == 0:
                sw.save(ckpt, bundle, state)
            if state.step >= args.steps:
                break


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] \
        if path.exists() else []


def restart(args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "--max-restarts=1", __file__, "worker", "restart", str(out),
               *_pass(args)]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
    killed = next(r["time"] for r in _lines(out / "rank1.jsonl") if r["event"] == "killed")
    steps = _lines(out / "rank0.jsonl")
    before = max(r["step"] for r in steps if r["event"] == "step" and r["attempt"] == 0)
    again = [r for r in steps if r["event"] == "step" and r["attempt"] == 1]
    resumed = next(r for r in steps if r["event"] == "start" and r["attempt"] == 1)["step"]
    past = next(r["time"] for r in again if r["step"] > before)
    return {"redone": before - resumed, "progress": past - killed,
            "trains_again": again[0]["time"] - killed, "resumed_from": resumed}


def torchft(args: argparse.Namespace, out: Path) -> dict:
    house = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "lighthouse", "--host",
                              "127.0.0.1", "--port", "0", "--min-replicas", "1",
                              "--join-timeout-ms", "2000", "--heartbeat-timeout-ms", "1000",
                              "--quorum-tick-ms", "10"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    port = re.search(r":(\d+) ", house.stdout.readline()).group(1)
    env = dict(os.environ, OMP_NUM_THREADS="1", NUM_REPLICA_GROUPS="2",
               TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")

    def start(group: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "worker", "torchft", str(out),
                                 *_pass(args)], env=dict(env, REPLICA_GROUP_ID=str(group)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    groups = [start(0), start(1)]
    try:
        while not any(r.get("step", 0) >= args.kill_at and r["event"] == "step"
                      for r in _lines(out / "group1.jsonl")):
            time.sleep(0.002)
        groups[1].kill()
        killed = time.time()
        groups[1].wait()
        groups[1] = start(1)
        for process in groups:
            process.wait(timeout=600)
    finally:
        for process in groups:
            if process.poll() is None:
                process.kill()
        house.terminate()
        house.wait()
    survivor = [r for r in _lines(out / "group0.jsonl") if r["event"] == "step"]
    before = max(r["step"] for r in survivor if r["time"] <= killed)
    past = next(r["time"] for r in survivor if r["time"] > killed and r["step"] > before
                and r["stepped"])
    back = [r for r in _lines(out / "group1.jsonl") if r["event"] == "step" and r["time"] > killed]
    discarded = sum(not r["stepped"] for r in survivor if r["time"] > killed)
    return {"redone": discarded, "progress": past - killed, "trains_again": back[0]["time"] - killed,
            "resumed_from": back[0]["step"] - 1}


def _pass(args: argparse.Namespace) -> list[str]:
    return ["--kill-at", str(args.kill_at), "--every", str(args.every), "--pause",
            str(args.pause), "--steps", str(args.steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every (restart)")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of compute a step")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.role:
        worker(args.role[1], Path(args.role[2]), args)
        return
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "a").mkdir()
        (Path(root) / "b").mkdir()
        old = restart(args, Path(root) / "a")
        new = torchft(args, Path(root) / "b")
    print(f"one kill in step {args.kill_at}, checkpoints every {args.every} steps, "
          f"{args.pause * 1000:.0f} ms of compute a step, 2 processes")
    print(f"{'':44} {'restart + checkpoint':>22} {'torchft groups':>16}")
    rows = [("steps computed again (torchft: discarded)", "redone", "{:d}"),
            ("kill -> progress past the kill (s)", "progress", "{:.2f}"),
            ("kill -> the killed process trains again (s)", "trains_again", "{:.2f}"),
            ("the killed process resumed from step", "resumed_from", "{:d}")]
    for label, key, form in rows:
        print(f"{label:44} {form.format(old[key]):>22} {form.format(new[key]):>16}")


if __name__ == "__main__":
    main()
