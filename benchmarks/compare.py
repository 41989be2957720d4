# Hand-written torch, shardwise and Accelerate on the same Llama, data and settings: one table.
"""Step time, time to first step, peak RSS and import time of three ways to train one model.

The same Llama-shaped Transformers model (about 10M parameters, random init), the same seeded
synthetic token batches (4 x 128 per rank, the model's own loss from ``labels``), 2 gloo
ranks (real processes on 127.0.0.1, a free port), in three implementations:

- hand-written: ``DistributedDataParallel``, or ``fully_shard`` per ``LlamaDecoderLayer``
  then the root; bf16 as ``torch.autocast("cpu", bfloat16)`` under DDP and as
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under FSDP2 (what
  ``sw.mixed_precision`` does on each); accumulation with ``no_sync()`` /
  ``set_requires_gradient_sync(False)``, the loss divided by the window.
- shardwise: ``sw.pipeline(sw.detect(), sw.replicate() or sw.shard(sw.by_class(...)),
  sw.mixed_precision(...), sw.accumulate_gradients(k))``, then ``bundle.step``.
- Accelerate (the optional ``bench`` extra): ``Accelerator(cpu=True, mixed_precision=...,
  gradient_accumulation_steps=k)``, ``prepare``, ``accelerator.backward``, and
  ``accelerator.accumulate`` when k > 1. On CPU it never runs FSDP: it takes a
  ``FullyShardedDataParallelPlugin(fsdp_version=2)`` and silently wraps in DDP. For the
  FSDP2 rows its FSDP2 path is forced (``AcceleratorState.distributed_type`` set to FSDP
  after construction, the plugin's mixed precision set as Accelerate would); the table
  marks those cells. Not installed: its cells say so.

All three use ``torch.optim.AdamW(params, lr=1e-4, fused=True)``, constructed identically:
``fused`` is passed explicitly so all three run the same kernel (shardwise may choose the
fused kernel by itself; the ratio is to measure the library, not the kernel). DDP is
``bucket_cap_mb=25, gradient_as_bucket_view=True`` in all three (shardwise's defaults).

Step time: per row, one 2-rank job builds the three side by side and times them in
alternating rounds (a block of batches of each per round, after a barrier, in an order
rotated every round), so machine noise and drift fall on all three alike. Wall time per
batch (a block lasts as long as its slower rank) and CPU time per batch (all threads of a
rank, the ranks' mean; less disturbed by other processes on a shared machine); each round's
blocks give a ratio to hand-written, reported as the median and (min-max). A batch is one
forward and backward; the accumulation rows step the optimizer every 4th and a block always
ends a window. Time to first step and peak RSS need fresh processes: each implementation
also runs alone in new 2-rank jobs, to the end of its first optimizer step: the time from
the worker's start (the parent, which forks the workers, has imported torch and Transformers,
as a training script has; Transformers imports Accelerate itself) and the larger of the two
ranks' peak RSS (VmHWM, counting what a worker shares with the parent). Import time: each
one's import after ``import torch``, in fresh interpreters, alternating. The last losses of
the three are compared: the same model, data and optimizer train alike.

``--device cuda`` (a machine with one NVIDIA GPU; without CUDA it says so and exits with 2):
one rank (NCCL, world size 1: NCCL cannot put two ranks on one GPU), every row by default
(bf16 is native there; every row gets the full rounds). Hand-written is what one writes for
one GPU: the plain model on cuda:0, bf16 as ``torch.autocast("cuda", bfloat16)``, no wrapper
on any row; shardwise places the model itself, and with one process its ``replicate()`` and
``shard()`` wrap nothing either; Accelerate is ``Accelerator(cpu=False)``, which wraps no DDP
at world size 1 but still applies FSDP2 on the fsdp2 rows: the table's ``model`` column
names the class each trained, so a ratio is read knowing who paid for a wrapper. Batches are
moved the same way for all three, by the harness: seeded on
the host in pinned memory, copied with ``.to("cuda", non_blocking=True)`` before each step,
inside the timed block. ``torch.cuda.synchronize()`` comes before every timer read (CPU time
then includes the wait for the GPU). Peak memory: ``torch.cuda.max_memory_allocated()`` of the
fresh job (one implementation alone, to the end of its first optimizer step), in addition to
peak RSS.

    OMP_NUM_THREADS=1 python benchmarks/compare.py [--rounds 24] [--steps 1] [--fresh 2]
        [--rows ddp,fsdp2,...] [--json PATH] [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from compare_impls import (
    BATCH,
    BUILDERS,
    IMPLS,
    IMPORTS,
    LR,
    MODEL,
    ROWS,
    SEQ,
    WORLD,
    Row,
    _init_group,
    _sync,
    _to,
    world,
)

# ---- workers (forked, one per rank) ----

def _batches(rank: int, device: str, count: int = 8) -> list[dict[str, Any]]:
    """Seeded token batches on the host; pinned when they are to be copied to a GPU."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, MODEL["vocab_size"], (count, BATCH, SEQ + 1), generator=gen)
    batches = [{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()} for x in ids]
    if device == "cuda":
        batches = [{key: value.pin_memory() for key, value in b.items()} for b in batches]
    return batches


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _machine_busy_s() -> float:
    """CPU seconds every process on this machine has used so far (/proc/stat)."""
    with open("/proc/stat") as stat:
        jiffies = [int(x) for x in stat.readline().split()[1:]]
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait


def first_step_job(impl: str, row: Row, device: str) -> dict[str, Any]:
    """Build ``impl`` in this fresh process and run it to the end of its first optimizer step."""
    start = time.perf_counter()
    step, note = BUILDERS[impl](row, device)
    for batch in _batches(int(os.environ["RANK"]), device)[:row.accumulate]:
        float(step(_to(batch, device)).detach())
    _sync(device)
    out = {"first_step_s": time.perf_counter() - start, "peak_rss_mib": _peak_rss_mib(),
           "note": note}
    if device == "cuda":  # this process has run only ``impl``: its peak is the implementation's
        import torch

        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def timing_job(impls: list[str], row: Row, rounds: int, block: int, device: str) -> dict[str, Any]:
    """All of ``impls`` side by side; per batch of each block, in alternating rounds: wall
    seconds, this rank's CPU seconds, and the CPU seconds the whole machine used."""
    import torch.distributed as dist

    _init_group(device)
    batches = _batches(int(os.environ["RANK"]), device)
    steps, notes, seen, losses = {}, {}, {}, {}
    for impl in impls:
        steps[impl], notes[impl] = BUILDERS[impl](row, device)
        seen[impl] = 0
    times: dict[str, list[tuple[float, float, float]]] = {impl: [] for impl in impls}
    for round_ in range(-1, rounds):  # round -1 warms up (first-step allocations, DDP buckets)
        for impl in impls[round_ % len(impls):] + impls[:round_ % len(impls)]:
            dist.barrier()
            _sync(device)
            start, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy_s()
            for _ in range(block):
                loss = steps[impl](_to(batches[seen[impl] % len(batches)], device))
                seen[impl] += 1
            _sync(device)
            losses[impl] = float(loss.detach())
            if round_ >= 0:
                times[impl].append(((time.perf_counter() - start) / block,
                                    (time.process_time() - cpu) / block,
                                    (_machine_busy_s() - busy) / block))
    dist.barrier()
    # the same batches in the same order: the last losses agree when the three train alike
    return {"times": times, "notes": notes, "last_loss": losses}


def _rank_main(rank: int, size: int, port: int, queue: Any, job: Callable[..., Any],
               args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        queue.put((rank, job(*args), None))
    except BaseException as exc:  # reported by the parent, with the rank
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    os._exit(0)  # no interpreter teardown with gloo threads alive; the result is written


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(job: Callable[..., Any], *args: Any, size: int = WORLD,
           timeout: float = 600) -> list[Any]:
    """``job(*args)`` on ``size`` forked ranks; their results by rank (RuntimeError on failure).
    On CUDA the parent must not have touched the GPU: a forked child could not use it."""
    ctx = mp.get_context("fork")  # the parent's torch and Transformers imports are shared
    queue, port = ctx.SimpleQueue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, queue, job, args))
             for r in range(size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            if not queue.empty():
                rank, value, error = queue.get()
                if error is not None:
                    raise RuntimeError(f"rank {rank}: {error}")
                results[rank] = value
            elif time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"{job.__name__}{args[:1]} timed out or a rank died")
            else:
                time.sleep(0.01)
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return [results[r] for r in range(size)]


def import_times(impls: list[str], rounds: int) -> dict[str, list[float]]:
    """Seconds of each one's import after ``import torch``, fresh interpreters, alternating."""
    code = "import time, torch; t = time.perf_counter(); {}; print(time.perf_counter() - t)"
    samples: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl in impls:
            out = subprocess.run([sys.executable, "-c", code.format(IMPORTS[impl])],
                                 capture_output=True, text=True, check=True).stdout
            samples[impl].append(float(out.split()[-1]))
    return samples


# ---- the run, the table and the JSON ----

def _summary(values: list[float]) -> dict[str, float]:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else 0.0}


def _divisor(row: Row, device: str) -> int:
    """Fewer rounds for the costlier rows on CPU; on CUDA a batch takes milliseconds."""
    return row.rounds_divisor if device == "cpu" else 1


def fresh_rounds(row: Row, impls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Each implementation alone in new jobs, in an order rotated every round: time to first
    step and peak RSS (the larger of the two ranks'); on CUDA also peak GPU memory."""
    peaks = ("peak_rss_mib", "peak_gpu_mib") if args.device == "cuda" else ("peak_rss_mib",)
    out: dict[str, Any] = {impl: {"first_step_s": [], **{key: [] for key in peaks}, "note": "",
                                  "error": None} for impl in impls}
    for round_ in range(max(1, args.fresh // _divisor(row, args.device))):
        for impl in impls[round_ % len(impls):] + impls[:round_ % len(impls)]:
            if out[impl]["error"]:
                continue
            try:
                ranks = launch(first_step_job, impl, row, args.device, size=world(args.device),
                               timeout=args.timeout)
            except RuntimeError as exc:
                out[impl]["error"] = str(exc)
                continue
            for key in ("first_step_s", *peaks):
                out[impl][key].append(max(r[key] for r in ranks))
            out[impl]["note"] = ranks[0]["note"]
    return out


def run_row(row: Row, impls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The fresh jobs, then the timing job, for one row; every list of samples summarised."""
    out = fresh_rounds(row, impls, args)
    timed = [impl for impl in impls if not out[impl]["error"]]
    rounds = max(1, args.rounds // _divisor(row, args.device))
    block = -(-args.steps // row.accumulate) * row.accumulate  # whole windows
    job = functools.partial(launch, timing_job, size=world(args.device), timeout=args.timeout)
    try:
        ranks = job(timed, row, rounds, block, args.device)
    except RuntimeError as exc:
        if "accelerate" not in timed:
            raise
        out["accelerate"]["error"] = f"in the timing job: {exc}"  # the others still compare
        timed.remove("accelerate")
        ranks = job(timed, row, rounds, block, args.device)
    for impl in timed:
        entry = out[impl]
        # a block lasts as long as its slower rank; CPU time: the ranks' mean (all threads)
        entry["ms_per_batch"] = [max(r["times"][impl][i][0] for r in ranks) * 1e3
                                 for i in range(rounds)]
        entry["cpu_ms_per_batch"] = [statistics.mean(r["times"][impl][i][1] for r in ranks) * 1e3
                                     for i in range(rounds)]
        entry["note"] = entry["note"] or ranks[0]["notes"][impl]
        entry["last_loss"] = ranks[0]["last_loss"][impl]
    # what other processes took of the machine meanwhile: busy CPU time less the ranks'
    blocks = [(r0[0], r0[2] - sum(r["times"][impl][i][1] for r in ranks))
              for impl in timed for i, r0 in enumerate(ranks[0]["times"][impl])]
    out["others_cpu_share"] = max(0.0, sum(b for _, b in blocks)) / (
        sum(w for w, _ in blocks) * (os.cpu_count() or 1))
    pairs = [(impl, "hand-written", "to_hand") for impl in timed]
    if "accelerate" in timed:
        pairs.append(("shardwise", "accelerate", "to_accelerate"))
    for impl, base, name in pairs:  # the per-round ratios first; then each list becomes its summary
        for key, ratio in (("ms_per_batch", "ratio"), ("cpu_ms_per_batch", "cpu_ratio")):
            out[impl][f"{ratio}_{name}"] = _summary(
                [a / b for a, b in zip(out[impl][key], out[base][key], strict=True)])
    for impl in timed:
        for key in ("ms_per_batch", "cpu_ms_per_batch", "first_step_s", "peak_rss_mib",
                    "peak_gpu_mib"):
            if key not in out[impl]:  # peak_gpu_mib: on CUDA only
                continue
            values = out[impl][key]
            out[impl][key] = {**_summary(values), "samples": values} if values else None
    last = [out[impl]["last_loss"] for impl in timed]
    out["loss_spread"] = (max(last) - min(last)) / abs(statistics.median(last))
    out["settings"] = {**dataclasses.asdict(row), "rounds": rounds, "batches_per_block": block}
    return out


def misses(rows: dict[str, Any]) -> list[str]:
    """Where shardwise / hand-written > 1.01, or shardwise / Accelerate > 1 (medians of the
    per-round ratios, wall or CPU time; the medians of time to first step)."""
    found = []
    for name, row in rows.items():
        ours, theirs = row["shardwise"], row.get("accelerate", {})
        if ours.get("ratio_to_hand") is None:
            found.append(f"{name}: shardwise did not run ({ours['error']})")
            continue
        for key, limit, other in (("ratio_to_hand", 1.01, "hand-written"),
                                  ("ratio_to_accelerate", 1.0, "Accelerate")):
            for prefix, what in (("", "wall"), ("cpu_", "CPU")):
                ratio = ours.get(prefix + key)
                if ratio and ratio["median"] > limit:
                    found.append(f"{name}: shardwise / {other} {ratio['median']:.3f} "
                                 f"({ratio['min']:.3f}-{ratio['max']:.3f}) > {limit} ({what} time)")
        if theirs.get("first_step_s") and ours["first_step_s"]["median"] > \
                theirs["first_step_s"]["median"]:
            found.append(f"{name}: shardwise {ours['first_step_s']['median']:.2f} s to first step "
                         f"> Accelerate's {theirs['first_step_s']['median']:.2f}")
    return found


def _cells(entry: dict[str, Any] | None, gpu: bool) -> list[str]:
    width = 8 if gpu else 6
    if entry is None:
        return ["not installed"] * width
    if entry.get("ms_per_batch") is None:
        return [f"failed: {entry['error']}"[:80]] + [""] * (width - 1)
    cells = []
    for key, ratio in (("ms_per_batch", "ratio_to_hand"), ("cpu_ms_per_batch", "cpu_ratio_to_hand")):
        ms, r = entry[key], entry[ratio]
        cells += [f"{ms['median']:.1f} ({ms['spread']:.0%})",
                  f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"]
    first, rss = entry["first_step_s"], entry["peak_rss_mib"]
    cells += [f"{first['median']:.2f}" if first else "", f"{rss['median']:.0f}" if rss else ""]
    if gpu:  # the class the model trained as (who wrapped at world size 1), peak GPU memory
        peak = entry["peak_gpu_mib"]
        cells += [entry["note"].split("; ")[-1], f"{peak['median']:.0f}" if peak else ""]
    return cells


def table(result: dict[str, Any], device: str = "cpu") -> str:
    gpu = device == "cuda"
    lines = ["| row | implementation | wall ms/batch (spread) | / hand-written (min-max) | "
             "CPU ms/batch (spread) | / hand-written (min-max) | first step s | "
             "peak RSS MiB/rank |" + (" model | peak GPU MiB |" if gpu else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if gpu else "")]
    for name, row in result["rows"].items():
        for impl in IMPLS:
            note = row[impl]["note"] if impl in row else ""
            label = f"{impl} (FSDP2 forced)†" if note.startswith("FSDP2 forced") else impl
            lines.append(f"| {name} | {label} | " + " | ".join(_cells(row.get(impl), gpu)) + " |")
    imports = result["import_ms"]
    lines.append("")
    if any(row.get("accelerate", {}).get("note", "").startswith("FSDP2 forced")
           for row in result["rows"].values()):
        lines.append("- † Accelerate on CPU takes a FullyShardedDataParallelPlugin(fsdp_version=2) "
                     "and silently wraps in DDP (distributed_type MULTI_CPU); its FSDP2 path was "
                     "forced by setting AcceleratorState.distributed_type = FSDP after construction.")
    versus = [(name, row["shardwise"]) for name, row in result["rows"].items()
              if "ratio_to_accelerate" in row["shardwise"]]
    if versus:
        lines.append("- shardwise / Accelerate, per-round ratios, median (min-max), wall; CPU: " + ", ".join(
            f"{name} {e['ratio_to_accelerate']['median']:.3f} ({e['ratio_to_accelerate']['min']:.3f}-"
            f"{e['ratio_to_accelerate']['max']:.3f}); {e['cpu_ratio_to_accelerate']['median']:.3f}"
            for name, e in versus))
    lines.append("- other processes' share of the machine's CPUs during the timed blocks: " +
                 ", ".join(f"{row['others_cpu_share']:.0%} ({name})"
                           for name, row in result["rows"].items()))
    lines.append("- same training: last losses of the three differ by at most " + ", ".join(
        f"{row['loss_spread']:.1e} ({name})" for name, row in result["rows"].items()) +
        " (relative)")
    why = {"hand-written": "the FSDP2 rows; DDP needs nothing more",
           "shardwise": "its parts load when first used, inside the first step",
           "accelerate": "Transformers imports it itself when it is installed"}
    lines.append("- import after `import torch`, fresh interpreters, median ms: " + "; ".join(
        f"`{IMPORTS[impl]}` {v['median']:.0f} ({why[impl]})" for impl, v in imports.items()))
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24,
                        help="timing rounds (fewer on the accumulation and bf16 rows)")
    parser.add_argument("--steps", type=int, default=1,
                        help="batches per block and round (at least one accumulation window)")
    parser.add_argument("--fresh", type=int, default=2, help="fresh-process rounds per row")
    parser.add_argument("--rows", help=f"a subset of {','.join(ROWS)} (default: all but "
                        "fsdp2-bf16; --quick: the fp32 rows; --device cuda: all)")
    parser.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "compare.json"),
                        help="where the results go (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: fp32 rows (every row with --device cuda), 2 rounds "
                        "of 1 batch, 1 fresh round, unless given")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one rank with NCCL on cuda:0 (default: %(default)s, 2 gloo ranks)")
    args = parser.parse_args(argv)
    if args.quick:
        given = argv if argv is not None else sys.argv[1:]
        for flag, value in (("--rounds", 2), ("--steps", 1), ("--fresh", 1)):
            if not any(a == flag or a.startswith(flag + "=") for a in given):
                setattr(args, flag[2:], value)
    args.rows = args.rows or ",".join(
        name for name, row in ROWS.items()
        if args.device == "cuda" or (row.precision == "fp32" if args.quick else row.default))
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; accepted: {', '.join(ROWS)}")
    return args


def cuda_device_name() -> str:
    """The name of cuda:0, or "" without CUDA. Asked of a fresh interpreter: a parent that
    has initialised CUDA cannot fork workers that use it."""
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    gpu = cuda_device_name() if args.device == "cuda" else ""
    if args.device == "cuda" and not gpu:
        print("compare.py --device cuda: no CUDA device here; run it on a machine with an "
              "NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    impls = [i for i in IMPLS if i != "accelerate" or importlib.util.find_spec("accelerate")]
    started = time.monotonic()
    imports = import_times(impls, max(1, args.fresh))
    # shared by the forked workers, as a training script has them before it starts
    import torch
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks/compare.py needs Transformers: pip install -e '.[bench]'")
    from transformers import LlamaForCausalLM  # noqa: F401

    torch.set_num_threads(1)
    if not args.quick:  # the first fork after the imports is slower: a job not counted
        launch(first_step_job, "hand-written", ROWS["ddp"], args.device,
               size=world(args.device), timeout=args.timeout)
    rows = {}
    for name in args.rows.split(","):
        rows[name] = run_row(ROWS[name], impls, args)
        print(f"{name}: done at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "accelerate" in impls:
        import accelerate
        versions["accelerate"] = accelerate.__version__
    result = {
        "command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
        "versions": versions, "cpus": os.cpu_count(), **({"gpu": gpu} if gpu else {}),
        "world_size": world(args.device), "model": MODEL,
        "batch_per_rank": [BATCH, SEQ], "lr": LR, "wall_s": time.monotonic() - started,
        "import_ms": {impl: _summary([t * 1e3 for t in v]) for impl, v in imports.items()},
        "rows": rows,
    }
    result["misses"] = misses(rows)
    with open(args.json, "w") as file:
        json.dump(result, file, indent=1)
    print(table(result, args.device))
    print("\ntargets: shardwise / hand-written <= 1.01 on every row, never slower than Accelerate")
    for line in result["misses"] or ["all met"]:
        print(f"  {line}")
    print(f"{result['wall_s']:.0f} s; JSON in {args.json}")


if __name__ == "__main__":
    main()
