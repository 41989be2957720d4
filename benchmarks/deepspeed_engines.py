# DeepSpeed's engine (ZeRO-1/2/3) beside the native engines: step time and per-rank state, one run.
"""Step time and per-rank state of the same model and data under each engine, on 2 gloo ranks.

Native: ``replicate`` (ZeRO-0), ``replicate + shard_optimizer`` (ZeRO-1),
``shard(reshard_after_forward=False)`` (ZeRO-2), ``shard`` (ZeRO-3). DeepSpeed:
``sw.deepspeed`` at stages 1, 2 and 3 with the same AdamW as its client optimizer. All
bundles are built first, then timed in alternating rounds (each round steps every bundle
in turn), so machine noise falls on all rows alike. "state held" is what this rank holds of
parameters (its shard), fp32 master copies and optimizer state.

    OMP_NUM_THREADS=1 python benchmarks/deepspeed_engines.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM, run_distributed

ROUNDS, STEPS_PER_ROUND, WARMUP = 8, 2, 2
MIB = 2**20
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "steps_per_print": 10**9}
PIPELINES = {
    "native ZeRO-0 replicate": lambda: [sw.replicate()],
    "native ZeRO-1 replicate+shard_optimizer": lambda: [sw.replicate(), sw.shard_optimizer()],
    "native ZeRO-2 shard(no reshard)": lambda: [sw.shard(reshard_after_forward=False)],
    "native ZeRO-3 shard": lambda: [sw.shard()],
    "deepspeed ZeRO-1": lambda: [sw.deepspeed({**DS, "zero_optimization": {"stage": 1}})],
    "deepspeed ZeRO-2": lambda: [sw.deepspeed({**DS, "zero_optimization": {"stage": 2}})],
    "deepspeed ZeRO-3": lambda: [sw.deepspeed({**DS, "zero_optimization": {"stage": 3}})],
}


def _bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    t = getattr(t, "ds_tensor", t)  # ZeRO-3: this rank's partition
    return t.numel() * t.element_size()


def _held(bundle: sw.Bundle) -> float:
    """MiB of parameters, fp32 master copies and optimizer state this rank holds."""
    total = sum(_bytes(p) for p in bundle.model.parameters())
    optimizers = [bundle.optimizer, bundle.sharded_optimizer]
    ds = getattr(bundle.engine, "ds", None)
    if ds is not None:
        inner = ds.optimizer
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            total += sum(_bytes(t) for t in getattr(inner, name, None) or [])
        optimizers = [getattr(inner, "optimizer", inner)]
    for optimizer in optimizers:
        if optimizer is None:
            continue
        optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own
        total += sum(_bytes(v) for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))
    return total / MIB


def run() -> dict[str, tuple[list[float], float]]:
    bundles = {}
    for name, parts in PIPELINES.items():
        torch.manual_seed(0)
        model = TinyTransformerLM(vocab=256, dim=128, heads=4, layers=6)
        loader = DataLoader(SyntheticTokens(size=4096, seq_len=64, vocab=256), batch_size=8,
                            shuffle=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        bundle = sw.pipeline(sw.detect(), *parts(), sw.mixed_precision("fp32"))(
            model, optimizer, loader)
        bundles[name] = [bundle, bundle.init(), iter(bundle.loader)]
    times: dict[str, list[float]] = {name: [] for name in bundles}
    for round_ in range(WARMUP + ROUNDS):
        for name, entry in bundles.items():
            bundle, state, batches = entry
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                state, out = bundle.step(state, next(batches))
            float(out.loss)
            elapsed = (time.perf_counter() - start) / STEPS_PER_ROUND
            entry[1] = state
            if round_ >= WARMUP:
                times[name].append(elapsed)
    return {name: (times[name], _held(entry[0])) for name, entry in bundles.items()}


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = run_distributed(run, world_size=2, timeout=1200)[0]
    base = statistics.median(rows["native ZeRO-0 replicate"][0])
    print("2 gloo ranks, rank 0; TinyTransformerLM dim 128, 6 layers, batch 8x64 per rank, "
          f"AdamW, fp32; median of {ROUNDS} alternating rounds of {STEPS_PER_ROUND} steps")
    print(f"  {'pipeline':<42}{'ms/step':>9}{'spread':>9}{'vs ZeRO-0':>11}{'state held MiB':>16}")
    for name, (samples, held) in rows.items():
        median = statistics.median(samples)
        spread = (max(samples) - min(samples)) / median
        print(f"  {name:<42}{median * 1e3:>9.1f}{spread:>8.0%} {median / base:>10.2f}"
              f"{held:>16.2f}")


if __name__ == "__main__":
    main()
