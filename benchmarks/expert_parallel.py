# expert_parallel() beside replicated experts on 2 ranks: step time, the all-to-all's share, expert bytes.
"""Step time of one Qwen3-MoE with its experts replicated on both ranks (``replicate()``,
ep=1) and split over them (``expert_parallel()``, ep=2), on 2 gloo ranks, for the same
global batch; the share of the ep=2 step spent in the all-to-alls (counts, tokens there and
back, measured by timing each call); and the expert bytes each rank holds.

Both bundles are built first, then timed in alternating rounds (each round steps both in
turn), so machine noise falls on both alike.

    OMP_NUM_THREADS=1 python benchmarks/expert_parallel.py [--rounds 5] [--steps 4]
        [--experts 16] [--tokens 512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import shardwise as sw
from shardwise.testing import run_distributed

PIPELINES = {"ep=1 (replicate)": lambda: [sw.replicate()],
             "ep=2 (expert_parallel)": lambda: [sw.expert_parallel()]}


def model(experts: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024,
        attn_implementation="sdpa"))


class Timed:
    """Wall time spent in ``torch.distributed.all_to_all_single`` (the autograd one calls it,
    forward and backward), summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(owner, name, timed)


def measure(rounds: int, steps: int, experts: int, tokens: int) -> dict[str, Any]:
    import torch.distributed as dist

    env = sw.detect()
    timed = Timed()
    timed.wrap(dist, "all_to_all_single")
    rows = tokens // 128
    ids = torch.randint(0, 1024, (rows, 128), generator=torch.Generator().manual_seed(env.rank))
    batch = {"input_ids": ids, "labels": ids}
    bundles, states = {}, {}
    for name, parts in PIPELINES.items():
        built = model(experts)
        bundles[name] = sw.pipeline(env, *parts())(built, torch.optim.AdamW(built.parameters()))
        states[name] = bundles[name].step(bundles[name].init(), batch)[0]  # warm up
    times: dict[str, list[float]] = {name: [] for name in PIPELINES}
    exchange: list[float] = []
    for _ in range(rounds):
        for name, bundle in bundles.items():
            timed.seconds = 0.0
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                states[name] = bundle.step(states[name], batch)[0]
            times[name].append((time.perf_counter() - start) / steps)
            if name.startswith("ep=2"):
                exchange.append(timed.seconds / steps)
    held = {}
    for name, bundle in bundles.items():
        module = bundle.engine.unwrap(bundle.model)
        held[name] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                         for n, p in module.named_parameters() if ".experts." in n)
    return {"ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "exchange_ms": statistics.median(exchange) * 1e3, "held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    args = parser.parse_args()
    results = run_distributed(measure, args.rounds, args.steps, args.experts, args.tokens,
                              world_size=2, timeout=1800)
    first = results[0]
    base = first["ms"]["ep=1 (replicate)"]
    print(f"Qwen3-MoE, {args.experts} experts top-2, 4 layers, {args.tokens} tokens per rank, "
          "2 gloo ranks, AdamW, median of rounds")
    print("| layout | ms/step | ratio | expert bytes per rank (MiB) | all-to-all ms (share) |")
    print("|---|---|---|---|---|")
    for name, ms in first["ms"].items():
        share = (f"{first['exchange_ms']:.1f} ({first['exchange_ms'] / ms:.0%})"
                 if name.startswith("ep=2") else "-")
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} | {first['held'][name] / 2**20:.1f} | "
              f"{share} |")


if __name__ == "__main__":
    main()
