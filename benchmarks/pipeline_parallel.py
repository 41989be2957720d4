# pipeline_parallel(size=2) under each schedule beside replicate() and shard() on 2 ranks.
"""Step time of one Llama on 2 gloo ranks for the same global batch: data parallel
(``replicate()``, DDP; ``shard()``, FSDP2: each rank half the batch) beside pipeline parallel
(``pipeline_parallel(size=2)``: each rank half the layers, the whole batch in microbatches)
under every torch schedule; and each pipeline rank's measured idle fraction beside the
schedule's theoretical bubble.

All bundles are built first, then timed in alternating rounds (each round steps every bundle
once), so machine noise falls on all alike. A rank's idle fraction is one minus the time its
stages spent computing (torch's ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk``, timed on each stage) over the step's time; the theoretical
bubble is (p - 1) / (v·m + p - 1) for p ranks, v stages a rank and m microbatches, before a
zero-bubble schedule fills it with weight-gradient work.

    OMP_NUM_THREADS=1 python benchmarks/pipeline_parallel.py [--rounds 3] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw
from shardwise.parallel.pp_schedule import SCHEDULES
from shardwise.testing import run_distributed

GLOBAL_BATCH = 8
LENGTH = 128


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=8,
                       intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=LENGTH, attn_implementation="sdpa",
                       tie_word_embeddings=False)


def pipelines(microbatches: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"replicate (DDP)": [sw.replicate()], "shard (FSDP2)": [sw.shard()]}
    for schedule in SCHEDULES:
        out[f"pp=2 {schedule}"] = [sw.pipeline_parallel(size=2, schedule=schedule,
                                                        microbatches=microbatches)]
    return out


def _timed(busy: list[float], method: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start
    return run


def instrument(bundle: sw.Bundle, busy: list[float]) -> None:
    """Time each of this rank's stages' compute into ``busy`` (after the first step built
    the schedule)."""
    for schedule in bundle.stages._built.values():  # type: ignore[union-attr]
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, _timed(busy, getattr(stage, name)))


def run(args: dict[str, Any]) -> dict[str, Any]:
    env = sw.detect()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (GLOBAL_BATCH, LENGTH), generator=gen)
    whole = {"input_ids": ids, "labels": ids}
    half = {k: v[env.rank::2] for k, v in whole.items()}
    bundles, batches, busy = {}, {}, {}
    for name, parts in pipelines(args["microbatches"]).items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config())
        bundles[name] = sw.pipeline(env, *parts)(model, torch.optim.AdamW(model.parameters()))
        batches[name] = whole if name.startswith("pp") else half
    states = {name: bundle.init() for name, bundle in bundles.items()}
    times: dict[str, list[float]] = {name: [] for name in bundles}
    for round_ in range(args["rounds"] + 1):  # the first round warms up (and builds schedules)
        for name, bundle in bundles.items():
            if round_ == 1 and bundle.stages is not None:
                busy[name] = [0.0]
                instrument(bundle, busy[name])
            torch.distributed.barrier()
            start = time.perf_counter()
            states[name], _ = bundle.step(states[name], batches[name])
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name, bundle in bundles.items():
        timed = times[name][1:]
        row: dict[str, Any] = {"ms": statistics.median(timed) * 1000}
        if bundle.stages is not None:
            row["idle"] = 1 - busy[name][0] / sum(timed)
            stages = bundle.stages
            row["bubble"] = stages.schedule.bubble(stages.size, stages.microbatches)
            row["microbatches"] = stages.microbatches
        rows[name] = row
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="pipeline microbatches per batch (default: the number of stages)")
    args = parser.parse_args(argv)
    ranks = run_distributed(run, {"rounds": args.rounds, "microbatches": args.microbatches},
                            world_size=2, timeout=1800)
    print(f"2 gloo ranks, Llama (hidden 256, 8 layers, 8/4 heads, vocab 2048), global batch "
          f"{GLOBAL_BATCH} x {LENGTH} tokens, AdamW; median of {args.rounds} rounds")
    print("| pipeline | microbatches | ms/step | tokens/s | rank 0 idle | rank 1 idle | "
          "theoretical bubble |")
    print("|---|---|---|---|---|---|---|")
    for name, row in ranks[0].items():
        tokens = GLOBAL_BATCH * LENGTH / (row["ms"] / 1000)
        if "idle" in row:
            idle = " | ".join(f"{r[name]['idle']:.0%}" for r in ranks)
            extra = f"{row['microbatches']} | {row['ms']:.0f} | {tokens:,.0f} | {idle} | " \
                    f"{row['bubble']:.0%} |"
        else:
            extra = f"- | {row['ms']:.0f} | {tokens:,.0f} | - | - | - |"
        print(f"| {name} | {extra}")


if __name__ == "__main__":
    main()
