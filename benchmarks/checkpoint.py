# Checkpoint cost on 2 CPU ranks: sw.save / sw.load (sharded DCP) vs rank 0 torch.save of a full state dict.
"""Save and load time and bytes written for a ~100M-parameter model with AdamW state, and
the training time a save costs, blocking against ``blocking=False``.

Both methods run in one 2-rank gloo job on the same sharded model: shardwise writes each
rank's shards in parallel; the baseline gathers the full model and optimizer state to rank
0 (``get_state_dict(full_state_dict=True, cpu_offload=True)``) and ``torch.save``s it.
Time lost per save: ``STEPS`` optimizer steps with a save after every ``EVERY``-th, minus
the same steps without saves, divided by the saves (the last one waited for); rounds of the
three alternate (none, blocking, async), the median kept.

The transaction's own cost is measured on the same checkpoint: taking and giving back the
root's writer lock, and deriving the manifest from DCP's metadata and checking every file
against what was written (the part of a save that is new with transactions), as a share of
the save. Then, in the same run, resuming part-way through an epoch of 1,000,000 samples at
sample 900,000: shardwise's sampler cursor against Accelerate's ``skip_first_batches``, time
to the first batch, with 0 and 2 workers.

    python benchmarks/checkpoint.py [--dim 768] [--layers 12] [--dir /tmp/sw-ckpt-bench]
        [--rounds 2] [--only positioning|fixed-cost|export]

``--only export``: ``sw.export`` of the ~97M-parameter model under shard() on 2 and 4 ranks
beside the old path (every tensor gathered to rank 0 and written there): time, and each
rank's peak resident growth as a share of the model; then Llama-70B's bytes per rank on 64
simulated ranks.

``--only fixed-cost``: the fixed cost of one save of a ~20 MiB model with AdamW state in one
process, median of 7: Accelerate's ``save_state`` beside ``sw.save``, and what the save is
made of (DCP's write with and without its fsyncs, the SHA-256 of the files, one
``torch.save`` of the whole state for scale).
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


STEPS, EVERY = 6, 2


def train_with_saves(bundle: sw.Bundle, state: sw.TrainState, batch: dict[str, torch.Tensor],
                     root: str, mode: str) -> tuple[sw.TrainState, float]:
    """Seconds for STEPS steps saving every EVERY-th ("none", "blocking" or "async")."""
    dist.barrier()
    start = time.perf_counter()
    for i in range(1, STEPS + 1):
        state, _ = bundle.step(state, batch)
        if mode != "none" and i % EVERY == 0:
            sw.save(root, bundle, bundle.check(state), keep_last=1, blocking=mode == "blocking")
    state = bundle.check(state)
    if mode == "async":
        from shardwise.checkpoint.background import wait_for_saves

        wait_for_saves()
    dist.barrier()
    return state, time.perf_counter() - start


def transaction_cost(root: Path, path: Path, repeat: int = 20) -> dict[str, float]:
    """Seconds to take and give back the root's lock, and to derive the manifest from DCP's
    metadata and check every file's type and size (each the median of ``repeat``)."""
    from shardwise.checkpoint import integrity, lock
    from shardwise.checkpoint.transaction import check_written

    sizes = {name: (path / name).stat().st_size for name in integrity.required(
        path, 2, {}, None)}
    locking, manifest = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        lock.acquire(root).release()
        locking.append(time.perf_counter() - start)
        start = time.perf_counter()
        integrity.required(path, 2, {}, None)
        check_written(path, sizes)
        manifest.append(time.perf_counter() - start)
    return {"lock_s": sorted(locking)[repeat // 2], "manifest_s": sorted(manifest)[repeat // 2]}


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i is a small tensor holding i (cheap, so the timings are the positioning's)."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def positioning(workers: int, batch: int = 1000, at: int = 900_000) -> dict[str, float]:
    """Seconds from a resume at sample ``at`` to its first batch: shardwise, Accelerate."""
    from accelerate import skip_first_batches
    from torch.utils.data import DataLoader

    def loader() -> DataLoader[torch.Tensor]:
        return DataLoader(Numbers(), batch_size=batch, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(0))

    bundle = sw.pipeline(sw.Env())(torch.nn.Linear(1, 1), None, loader())
    start = time.perf_counter()
    bundle.loader.resume(0, at // batch, cursor=at)
    first = next(iter(bundle.loader))
    ours = time.perf_counter() - start
    start = time.perf_counter()
    skipped = skip_first_batches(loader(), num_batches=at // batch)
    theirs_first = next(iter(skipped))
    theirs = time.perf_counter() - start
    assert first.shape == theirs_first.shape == (batch, 16)
    return {"sw": ours, "accelerate": theirs}


def bench(dim: int, layers: int, root: str, rounds: int) -> dict[str, float]:
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
        out.update(transaction_cost(Path(root), path))

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
    batch = {"input_ids": ids, "labels": ids}
    times: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
    for _ in range(rounds):
        for mode in times:
            state, seconds = train_with_saves(bundle, state, batch, str(Path(root) / mode), mode)
            times[mode].append(seconds)
    for mode, samples in times.items():
        out[f"train_{mode}_s"] = sorted(samples)[len(samples) // 2]
    return out


def export_bench(dim: int, layers: int, root: str, method: str) -> dict[str, float]:
    """One rank of ``--only export``, in fresh processes for each method: the model under
    shard() after one step, exported by ``method`` ("gather": every tensor gathered to rank
    0 and written there, the old path; "one_file" / "files": ``sw.export`` into one file or
    one per rank); the peak resident growth during it and its time."""
    from shardwise.checkpoint.full_weights import _write_gathered
    from shardwise.testing import PeakGrowth

    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=8000, dim=dim, heads=12, layers=layers, max_len=64)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    bundle = sw.pipeline(sw.detect(), sw.shard())(model, torch.optim.SGD(model.parameters()))
    ids = torch.randint(0, 8000, (1, 16))
    bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    world = dist.get_world_size()
    out = Path(root) / f"{method}-{world}"
    if method == "gather" and dist.get_rank() == 0:
        out.mkdir(parents=True)
    dist.barrier()
    with PeakGrowth() as grown:
        start = time.perf_counter()
        if method == "gather":
            _write_gathered(bundle, out, None)
            dist.barrier()
        else:
            files = 1 if method == "one_file" else world
            sw.export(out, bundle, max_shard_size=-(-model_bytes // files))
        seconds = time.perf_counter() - start
    return {"model_bytes": model_bytes, "s": seconds, "growth": grown.bytes}


def print_export(dim: int, layers: int, root: str) -> None:
    print("sw.export of a model under shard(): peak resident growth per rank (x the model's "
          "bytes; each method in fresh processes) and time")
    for world in (2, 4):
        shutil.rmtree(root, ignore_errors=True)
        print(f"  {world} gloo ranks:")
        for method, label in (("gather", "gather to rank 0 (old)"),
                              ("one_file", "sw.export, one file"),
                              ("files", f"sw.export, {world} files")):
            rows = run_distributed(export_bench, dim, layers, root, method, world_size=world,
                                   timeout=3600)
            size = rows[0]["model_bytes"]
            growth = [r["growth"] / size for r in rows]
            print(f"    {label:<24} {max(r['s'] for r in rows):6.2f} s   growth "
                  + " ".join(f"{g:4.2f}x" for g in growth) + f"   (max {max(growth):.2f}x; "
                  f"{size / 4e6:.1f}M parameters, {size / 2**20:.0f} MiB)")
    shutil.rmtree(root, ignore_errors=True)
    print_simulated_export()


def print_simulated_export(world: int = 64, file_bytes: int = 5 * 10**9) -> None:
    """Llama-70B in bf16 under shard() over ``world`` simulated ranks (shapes only, on the
    meta device): the bytes each rank writes with sw.export (its FSDP2 shards as DCP
    pieces, then its share of the consolidated files), against the gather's rank 0."""
    import math

    from scale import llama  # the shapes benchmarks/scale.py simulates

    from shardwise.checkpoint.hf_files import file_plan

    with torch.device("meta"):
        model = llama("70B")
    sizes = [(name, t.numel() * 2) for name, t in model.state_dict().items()]
    total = sum(size for _, size in sizes)
    pieces = [0] * world
    for _, tensor in model.state_dict().items():  # FSDP2 splits dim 0 into world chunks
        rows = tensor.shape[0]
        per = math.ceil(rows / world)
        rest = tensor.numel() // rows * 2
        for rank in range(world):
            pieces[rank] += max(0, min(per, rows - rank * per)) * rest
    plan = file_plan(sizes, max(1, math.ceil(total / file_bytes)))
    files = [0] * world
    for name, size in sizes:
        files[plan[name] % world] += size
    written = [p + f for p, f in zip(pieces, files, strict=True)]
    gb = 1e9
    print(f"  Llama-70B bf16 ({total / gb:.0f} GB) under shard() over {world} simulated ranks, "
          f"{max(plan.values())} files of <= {file_bytes / gb:.0f} GB:")
    print(f"    sw.export: each rank writes {min(written) / gb:.1f}-{max(written) / gb:.1f} GB "
          f"(its shards {max(pieces) / gb:.1f} GB, at most one file's share "
          f"{max(files) / gb:.1f} GB), holds one tensor at a time beside its shards")
    print(f"    gather to rank 0: rank 0 writes and holds {total / gb:.0f} GB")


def print_positioning() -> None:
    print("resume at sample 900,000 of 1,000,000 (batches of 1000), time to the first batch:")
    for workers in (0, 2):
        t = positioning(workers)
        print(f"  num_workers={workers}  shardwise cursor {t['sw']:7.3f} s   Accelerate "
              f"skip_first_batches {t['accelerate']:7.2f} s   ratio "
              f"{t['accelerate'] / t['sw']:5.1f}x")


def fixed_cost(root: str, repeat: int = 7) -> dict[str, float]:
    """Median seconds of one save of a ~20 MiB model (AdamW state: ~60 MiB written)."""
    import hashlib
    import statistics

    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from torch.distributed.checkpoint import FileSystemWriter

    def stepped() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyTransformerLM(vocab=1024, dim=256, heads=4, layers=6)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optimizer = stepped()
    bundle = sw.pipeline(sw.Env())(model, optimizer)
    ids = torch.randint(0, 1024, (2, 16))
    state, _ = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    accelerator = Accelerator(cpu=True)
    prepared, prepared_opt = accelerator.prepare(*stepped())
    prepared(ids, labels=ids)["loss"].backward()
    prepared_opt.step()
    model_sd, opt_sd = get_state_dict(model, optimizer)
    whole = {"model": model_sd, "optimizer": opt_sd}
    base = Path(root)

    dcp.save(whole, storage_writer=FileSystemWriter(base / "reference"), no_dist=True)

    def sha(target: Path) -> None:
        for file in sorted(p for p in (base / "reference").rglob("*") if p.is_file()):
            hashlib.sha256(file.read_bytes()).hexdigest()

    ways = {"accelerate": lambda t: accelerator.save_state(str(t)),
            "sw": lambda t: sw.save(t, bundle, state),
            # what training waits for: the state copied to host memory, the writing goes on
            "sw_async": lambda t: sw.save(t, bundle, state, blocking=False),
            "dcp": lambda t: dcp.save(whole, storage_writer=FileSystemWriter(t), no_dist=True),
            "dcp_nosync": lambda t: dcp.save(whole, storage_writer=FileSystemWriter(
                t, sync_files=False), no_dist=True),
            "torch_save": lambda t: (t.mkdir(), torch.save(whole, t / "all.pt")),
            "sha256": sha}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeat):  # rounds alternate the ways: a busy moment hits them all
        for name, way in ways.items():
            target = base / f"{name}{i}"
            start = time.perf_counter()
            handle = way(target)
            times[name].append(time.perf_counter() - start)
            if isinstance(handle, sw.AsyncSave):  # written before the next way runs
                handle.result()
            shutil.rmtree(target, ignore_errors=True)
    out = {name: statistics.median(found) for name, found in times.items()}
    out["params"] = sum(p.numel() for p in model.parameters())
    out["bytes"] = size_of(base / "reference")
    return out


def print_fixed_cost(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    r = fixed_cost(root)
    shutil.rmtree(root, ignore_errors=True)
    ms = 1e3
    print(f"one save of {r['params'] / 1e6:.2f}M parameters ({r['params'] * 4 / 2**20:.1f} MiB) "
          f"with AdamW state ({r['bytes'] / 2**20:.1f} MiB written), one process, median of 7:")
    print(f"  Accelerate save_state          {r['accelerate'] * ms:7.1f} ms")
    print(f"  sw.save                        {r['sw'] * ms:7.1f} ms   "
          f"{r['sw'] / r['accelerate']:4.1f}x Accelerate")
    print(f"  sw.save(blocking=False) returns {r['sw_async'] * ms:7.1f} ms   "
          f"{r['sw_async'] / r['accelerate']:4.1f}x Accelerate (training waits this long; the "
          "files are written in the background)")
    print("  of which, measured alone:")
    print(f"    DCP write (fsync'd files)    {r['dcp'] * ms:7.1f} ms   "
          f"{r['dcp'] / r['accelerate']:4.1f}x Accelerate")
    print(f"    DCP write without fsync      {r['dcp_nosync'] * ms:7.1f} ms")
    print(f"    SHA-256 of the files         {r['sha256'] * ms:7.1f} ms")
    print(f"  torch.save of the whole state  {r['torch_save'] * ms:7.1f} ms (for scale)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dir", default="/tmp/sw-ckpt-bench")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=["positioning", "fixed-cost", "export"], default=None)
    args = parser.parse_args()
    if args.only == "export":
        print_export(args.dim, args.layers, args.dir)
        return
    if args.only == "positioning":
        print_positioning()
        return
    if args.only == "fixed-cost":
        print_fixed_cost(args.dir)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    r = run_distributed(bench, args.dim, args.layers, args.dir, args.rounds, world_size=2,
                        timeout=3600)[0]
    shutil.rmtree(args.dir, ignore_errors=True)
    gb = 1e9
    print(f"model: {r['params'] / 1e6:.1f}M parameters, AdamW state, 2 gloo ranks, shard()")
    print(f"  sw.save (DCP, sharded)      {r['sw_save_s']:7.2f} s   {r['sw_bytes'] / gb:6.2f} GB")
    print(f"  sw.load                     {r['sw_load_s']:7.2f} s")
    print(f"  rank-0 gather + torch.save  {r['full_save_s']:7.2f} s   {r['full_bytes'] / gb:6.2f} GB")
    print(f"  rank-0 torch.load (only)    {r['full_load_s']:7.2f} s")
    print(f"  save ratio sw / rank-0      {r['sw_save_s'] / r['full_save_s']:7.2f}")
    print(f"  writer lock, take + give    {r['lock_s'] * 1e3:7.3f} ms  "
          f"({100 * r['lock_s'] / r['sw_save_s']:.3f}% of the save)")
    print(f"  manifest from metadata + file checks {r['manifest_s'] * 1e3:7.3f} ms  "
          f"({100 * r['manifest_s'] / r['sw_save_s']:.3f}% of the save)")
    saves = STEPS // EVERY
    base = r["train_none_s"]
    print(f"training {STEPS} steps, a save every {EVERY} ({saves} saves), median of "
          f"{args.rounds} alternating rounds:")
    for mode in ("none", "blocking", "async"):
        lost = (r[f"train_{mode}_s"] - base) / saves
        print(f"  {mode:<9} {r[f'train_{mode}_s']:7.2f} s   lost per save {lost:6.2f} s")
    print_positioning()


if __name__ == "__main__":
    main()
