# shardwise replicate vs a hand-written DDP loop on 2 CPU ranks: the same model, data and steps.
"""Step time of ``sw.replicate()`` against hand-written ``DistributedDataParallel``.

Both run in the same 2-rank gloo job on the tiny transformer LM, with the same data,
AdamW and settings, alternating blocks of steps; medians of step time and their ratio
are printed. Target: shardwise / hand-written <= 1.02.

    python benchmarks/step_overhead.py [--rounds 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM, run_distributed


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=64, heads=4, layers=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def bench(rounds: int, steps: int) -> dict[str, list[float]]:
    data = SyntheticTokens(size=64, seq_len=32, vocab=64)
    batch = {"input_ids": data.inputs[:8], "labels": data.labels[:8]}

    hand_model, hand_opt = model_and_optimizer()
    bundle = sw.pipeline(sw.detect(), sw.replicate())(*model_and_optimizer())
    ddp = DistributedDataParallel(hand_model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    state = bundle.init()

    def hand() -> None:
        loss = ddp(**batch)["loss"]
        loss.backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    def ours() -> None:
        nonlocal state
        state, _ = bundle.step(state, batch)

    times: dict[str, list[float]] = {"hand": [], "shardwise": []}
    for fn in (hand, ours):  # warm-up
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in (("hand", hand), ("shardwise", ours)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    times = run_distributed(bench, args.rounds, args.steps, world_size=2, timeout=600)[0]
    hand, ours = (statistics.median(times[k]) * 1e3 for k in ("hand", "shardwise"))
    print(f"hand-written DDP  {hand:7.3f} ms/step (median, rank 0, {args.rounds} rounds x "
          f"{args.steps} steps, 2 gloo ranks)")
    print(f"shardwise         {ours:7.3f} ms/step")
    print(f"ratio             {ours / hand:7.3f}   target <= 1.02")


if __name__ == "__main__":
    main()
