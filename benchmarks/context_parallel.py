# context_parallel(size=2) beside whole sequences on 2 ranks: step time, activations, longest sequence.
"""Step time and per-rank activations of one Llama with each sequence whole on a rank
(``replicate()``, cp=1) and split over both ranks (``context_parallel(size=2)``, Ulysses),
on 2 gloo ranks, for the same global batch of 2 sequences; then the longest sequence each
fits in a per-rank activation budget.

At each length both bundles are built first, then timed in alternating rounds (each round
steps both in turn), so machine noise falls on both alike. "activations held" is what this
rank's forward saved for backward, counted by a ``saved_tensors_hooks`` during one step
(distinct storages, parameters excluded); "estimate" is ``sw.estimate_memory``'s for the
same pipeline and one data rank's batch. The longest sequence is the largest power-of-two
length whose estimated activations fit ``--budget`` MiB a rank, one sequence a data rank.

Only Ulysses runs: torch's ring attention splits CUDA's SDPA only (docs/parallelism.md).

    OMP_NUM_THREADS=1 python benchmarks/context_parallel.py [--lengths 512 1024 2048]
        [--rounds 3] [--budget 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw
from shardwise.testing import run_distributed

MIB = 2**20
GLOBAL_BATCH = 2  # sequences
PIPELINES = {"cp=1 (replicate)": lambda: [sw.replicate()],
             "cp=2 (ulysses)": lambda: [sw.context_parallel(size=2), sw.replicate()]}


def config(length: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=4,
                       intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=max(length, 2048), attn_implementation="sdpa")


def saved_bytes(bundle: sw.Bundle, batch: dict[str, torch.Tensor]) -> int:
    """Bytes this rank's forward saves for backward in one step (distinct storages)."""
    seen = {p.untyped_storage()._cdata for p in bundle.model.parameters()}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bundle.step(bundle.init(), batch)
    return total[0]


def run(args: dict[str, Any]) -> dict[str, Any]:
    """In each rank: per length, both bundles timed in alternating rounds; activations."""
    env = sw.detect()
    rows: dict[str, Any] = {}
    for length in args["lengths"]:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 2048, (GLOBAL_BATCH, length), generator=gen)
        whole = {"input_ids": ids, "labels": ids}
        mine = {k: v[env.rank:env.rank + 1] for k, v in whole.items()}  # cp=1: one each
        bundles, batches = {}, {}
        for name, parts in PIPELINES.items():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config(length))
            estimate = sw.estimate_memory(model, parts(), env, batch=mine if "cp=1" in name
                                          else whole)
            bundle = sw.pipeline(env, *parts())(model, torch.optim.AdamW(model.parameters()))
            bundles[name], batches[name] = bundle, mine if "cp=1" in name else whole
            rows[f"{name} {length}"] = {"estimate": estimate.activations_bytes}
        states = {name: bundle.init() for name, bundle in bundles.items()}
        times: dict[str, list[float]] = {name: [] for name in bundles}
        for _ in range(args["rounds"] + 1):  # the first round warms up
            for name, bundle in bundles.items():
                torch.distributed.barrier()
                start = time.perf_counter()
                states[name], _ = bundle.step(states[name], batches[name])
                times[name].append(time.perf_counter() - start)
        for name, bundle in bundles.items():
            row = rows[f"{name} {length}"]
            row["ms"] = statistics.median(times[name][1:]) * 1000
            row["held"] = saved_bytes(bundle, batches[name])
    return rows


def longest(budget: int, top: int = 2**20) -> dict[str, int]:
    """The longest power-of-two sequence whose estimated activations fit ``budget`` bytes a
    rank, for each pipeline on 2 ranks, one sequence a data rank: whole on each rank at cp=1,
    split over both at cp=2 (estimated in one process: nothing runs)."""
    env = sw.Env(world_size=2, local_world_size=2)
    found = {}
    for name, parts in PIPELINES.items():
        length, fits = 256, 0
        while length <= top:
            with torch.device("meta"):
                model = LlamaForCausalLM(config(length))
            ids = torch.zeros(1, length, dtype=torch.long)
            est = sw.estimate_memory(model, parts(), env, batch={"input_ids": ids, "labels": ids})
            if (est.activations_bytes or 0) > budget:
                break
            fits, length = length, length * 2
        found[name] = fits
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=256, help="MiB of activations a rank")
    args = parser.parse_args(argv)
    rows = run_distributed(run, {"lengths": args.lengths, "rounds": args.rounds},
                           world_size=2, timeout=1800)[0]
    print(f"2 gloo ranks, Llama (hidden 256, 4 layers, 8/4 heads, vocab 2048), global batch "
          f"{GLOBAL_BATCH} sequences, AdamW; rank 0's figures")
    print("| pipeline | length | ms/step | tokens/s | activations held MiB | estimate MiB |")
    print("|---|---|---|---|---|---|")
    for key, row in rows.items():
        name, length = key.rsplit(" ", 1)
        tokens = GLOBAL_BATCH * int(length) / (row["ms"] / 1000)
        print(f"| {name} | {length} | {row['ms']:.0f} | {tokens:,.0f} | "
              f"{row['held'] / MIB:.1f} | {(row['estimate'] or 0) / MIB:.1f} |")
    fits = longest(int(args.budget * MIB))
    print(f"\nlongest power-of-two sequence whose estimated activations fit {args.budget:g} MiB "
          "a rank: " + ", ".join(f"{name} {length}" for name, length in fits.items()))


if __name__ == "__main__":
    main()
