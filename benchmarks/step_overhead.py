# shardwise vs hand-written torch on 2 CPU ranks: replicate vs DDP, shard vs FSDP2.
"""Step time of ``sw.replicate()`` against hand-written ``DistributedDataParallel``, and of
``sw.shard()`` against a hand-written FSDP2 (``fully_shard`` per block, then the root) loop.

All four run in the same 2-rank gloo job on the tiny transformer LM, with the same data,
AdamW (``fused=True``: the kernel shardwise switches a default AdamW to) and settings,
alternating blocks of steps; medians of step time and their ratios are printed. Target:
shardwise / hand-written <= 1.02.

    python benchmarks/step_overhead.py [--rounds 40] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM, run_distributed


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=64, heads=4, layers=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def hand_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
              batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def shardwise_step(transform: sw.Transform, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    bundle = sw.pipeline(sw.detect(), transform)(*model_and_optimizer())
    state = bundle.init()

    def step() -> None:
        nonlocal state
        state, _ = bundle.step(state, batch)
    return step


def bench(rounds: int, steps: int) -> dict[str, list[float]]:
    data = SyntheticTokens(size=64, seq_len=32, vocab=64)
    batch = {"input_ids": data.inputs[:8], "labels": data.labels[:8]}
    sw.ensure_process_group(sw.detect())

    ddp_model, ddp_opt = model_and_optimizer()
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    fsdp_model, fsdp_opt = model_and_optimizer()
    for block in fsdp_model.layers:
        fully_shard(block)
    fully_shard(fsdp_model)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-3)  # over the sharded params

    loops = {
        "DDP by hand": hand_step(ddp, ddp_opt, batch),
        "sw.replicate": shardwise_step(sw.replicate(), batch),
        "FSDP2 by hand": hand_step(fsdp_model, fsdp_opt, batch),
        "sw.shard": shardwise_step(sw.shard(), batch),
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    for fn in loops.values():  # warm-up
        for _ in range(3):
            fn()
    order = list(loops.items())
    for round_ in range(rounds):
        # pairs run back to back, and the order flips every round so drift cancels
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times = run_distributed(bench, args.rounds, args.steps, world_size=2, timeout=900)[0]
    median = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(f"median ms/step on rank 0, {args.rounds} rounds x {args.steps} steps, 2 gloo ranks")
    for name, value in median.items():
        print(f"  {name:<15} {value:8.3f}")
    for ours, hand in (("sw.replicate", "DDP by hand"), ("sw.shard", "FSDP2 by hand")):
        paired = statistics.median(a / b for a, b in zip(times[ours], times[hand], strict=True))
        print(f"  {ours} / {hand}: {median[ours] / median[hand]:.3f} (ratio of medians), "
              f"{paired:.3f} (median of per-round ratios)   target <= 1.02")


if __name__ == "__main__":
    main()
