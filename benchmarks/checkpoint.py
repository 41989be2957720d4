# Checkpoint cost on 2 CPU ranks: sw.save / sw.load (sharded DCP) vs rank 0 torch.save of a full state dict.
"""Save and load time and bytes written for a ~100M-parameter model with AdamW state.

Both methods run in one 2-rank gloo job on the same sharded model: shardwise writes each
rank's shards in parallel; the baseline gathers the full model and optimizer state to rank
0 (``get_state_dict(full_state_dict=True, cpu_offload=True)``) and ``torch.save``s it.

    python benchmarks/checkpoint.py [--dim 768] [--layers 12] [--dir /tmp/sw-ckpt-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import shardwise as sw
from shardwise.testing import TinyTransformerLM, run_distributed


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench(dim: int, layers: int, root: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=8000, dim=dim, heads=12, layers=layers, max_len=64)
    params = sum(p.numel() for p in model.parameters())
    bundle = sw.pipeline(sw.detect(), sw.shard())(model, torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 8000, (1, 16))
    state, _ = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    rank = dist.get_rank()
    out: dict[str, float] = {"params": params}

    dist.barrier()
    start = time.perf_counter()
    path = sw.save(root, bundle, state)
    out["sw_save_s"] = time.perf_counter() - start
    start = time.perf_counter()
    sw.load(root, bundle)
    out["sw_load_s"] = time.perf_counter() - start
    if rank == 0:
        out["sw_bytes"] = size_of(path)

    dist.barrier()
    start = time.perf_counter()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(bundle.model, bundle.optimizer, options=options)
    full = Path(root) / "full.pt"
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd}, full)
    dist.barrier()
    out["full_save_s"] = time.perf_counter() - start
    if rank == 0:
        out["full_bytes"] = full.stat().st_size
        start = time.perf_counter()
        torch.load(full, weights_only=True)
        out["full_load_s"] = time.perf_counter() - start  # rank 0 read only, before scatter
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dir", default="/tmp/sw-ckpt-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    r = run_distributed(bench, args.dim, args.layers, args.dir, world_size=2, timeout=1200)[0]
    shutil.rmtree(args.dir, ignore_errors=True)
    gb = 1e9
    print(f"model: {r['params'] / 1e6:.1f}M parameters, AdamW state, 2 gloo ranks, shard()")
    print(f"  sw.save (DCP, sharded)      {r['sw_save_s']:7.2f} s   {r['sw_bytes'] / gb:6.2f} GB")
    print(f"  sw.load                     {r['sw_load_s']:7.2f} s")
    print(f"  rank-0 gather + torch.save  {r['full_save_s']:7.2f} s   {r['full_bytes'] / gb:6.2f} GB")
    print(f"  rank-0 torch.load (only)    {r['full_load_s']:7.2f} s")
    print(f"  save ratio sw / rank-0      {r['sw_save_s'] / r['full_save_s']:7.2f}")


if __name__ == "__main__":
    main()
