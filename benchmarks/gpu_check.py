# The GPU paths a CPU machine cannot run: CUDA, bf16 on CUDA, pinned batches, NCCL, host syncs.
"""Checks and figures for a machine with one NVIDIA GPU, printed as a table.

Run it where a GPU is at hand (``bash benchmarks/gpu_check.sh``). On a machine without CUDA
it says so and exits with 2. Each row is a check (OK / FAIL with what was seen) or a figure:

- ``detect``: the device is ``cuda``, the backend ``nccl``, bf16 among the precisions.
- ``default precision``: with no ``mixed_precision`` given, the pipeline chose bf16.
- ``pinned batches``: ``distribute_data`` rebuilt the loader with ``pin_memory=True`` and
  batches arrive on the GPU (copied with ``non_blocking=True``).
- ``nccl``: a one-rank NCCL group all-reduces a CUDA tensor (the backend shardwise picks).
- ``host syncs / step``: ``torch.cuda.set_sync_debug_mode("warn")`` counts the operations
  that wait for the GPU during 10 optimizer steps of the default pipeline: 0 expected (the
  finiteness flag goes to the fused optimizer and is read one step later from pinned memory).
- ``ms / step`` in fp32 and bf16 for a small LM, median of 20 steps after 5.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM

ROWS: list[tuple[str, str]] = []


def row(name: str, ok: bool | None, seen: str) -> None:
    ROWS.append((name, ("OK  " if ok else "FAIL") + f" {seen}" if ok is not None else seen))


def build(parts: list[sw.Transform]) -> sw.Bundle:
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=256, dim=256, heads=4, layers=4, max_len=128)
    loader = DataLoader(SyntheticTokens(size=4096, seq_len=128, vocab=256), batch_size=16,
                        shuffle=True)
    return sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters()), loader)


def step_time(bundle: sw.Bundle) -> float:
    state, batches, times = bundle.init(), iter(bundle.loader), []
    for i in range(25):
        torch.cuda.synchronize()
        start = time.perf_counter()
        state, _ = bundle.step(state, next(batches))
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a machine with an NVIDIA GPU")
        return 2
    env = sw.detect()
    row("detect", env.device.type == "cuda" and env.backend == "nccl" and "bf16" in env.precisions,
        f"device {env.device}, backend {env.backend}, precisions {env.precisions}")
    pipe = sw.pipeline(env)
    chosen = [t for t in pipe.transforms if type(t).__name__ == "MixedPrecision"]
    row("default precision", bool(chosen) and chosen[0] == sw.mixed_precision("bf16"),
        repr(chosen[0]) if chosen else "none")
    bundle = build([])
    inner = getattr(bundle.loader, "loader", None)
    batch = next(iter(bundle.loader))
    on_gpu = all(v.is_cuda for v in batch.values())
    row("pinned batches", bool(getattr(inner, "pin_memory", False)) and on_gpu,
        f"loader pin_memory={getattr(inner, 'pin_memory', None)}, batch on cuda={on_gpu}")
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    value = torch.ones(4, device="cuda")
    dist.all_reduce(value)
    row("nccl", bool(value.sum().item() == 4), f"all_reduce on {value.device}")
    state, batches = bundle.init(), iter(bundle.loader)
    state, _ = bundle.step(state, next(batches))  # warm-up, outside the count
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            state, _ = bundle.step(state, next(batches))
    torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    fused = bundle.optimizer.param_groups[0].get("fused")
    row("host syncs / step", not syncs, f"{len(syncs) / 10:.1f} over 10 steps of sw.step, "
        f"default pipeline, AdamW fused={fused} (0 expected: the flag is read a step late)")
    for precision in ("fp32", "bf16"):
        row(f"ms / step {precision}", None,
            f"{step_time(build([sw.mixed_precision(precision)])):.2f}")
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    for name, text in ROWS:
        print(f"  {name:<20} {text}")
    return 1 if any(text.startswith("FAIL") for _, text in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
