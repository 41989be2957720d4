# tensor_parallel(size=2) beside shard() and replicate() on 2 ranks: step time and per-rank state, one run.
"""Step time and per-rank state of one Llama under each distribution, on 2 gloo ranks.

Rows: ``replicate()`` (DDP), ``shard()`` (FSDP2 over both ranks), ``tensor_parallel(size=2)``
(the model's own plan: attention and MLP projections, embedding and head split over both
ranks, norms whole), each with AdamW and the same global batch (tensor parallel reads the
whole global batch on both ranks, the others half each). All bundles are built first, then
timed in alternating rounds (each round steps every bundle in turn), so machine noise falls
on all rows alike. "state held" is this rank's parameters, gradients and optimizer state
after a step and a backward (all three at once); "estimate" is ``sw.estimate_memory``.

    OMP_NUM_THREADS=1 python benchmarks/tensor_parallel.py [--hidden 512] [--layers 4]
        [--rounds 6] [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw
from shardwise.testing import run_distributed

MIB = 2**20
GLOBAL_BATCH, SEQ = 8, 128
PIPELINES = {
    "replicate (DDP)": lambda: [sw.replicate()],
    "shard (FSDP2)": lambda: [sw.shard()],
    "tensor_parallel(size=2)": lambda: [sw.tensor_parallel(size=2)],
}


def _bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _held(bundle: sw.Bundle, optimizer: torch.optim.Optimizer) -> int:
    params = list(bundle.model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (sum(map(_bytes, params)) + sum(_bytes(p.grad) for p in params if p.grad is not None)
            + sum(map(_bytes, state)))


def run(args: dict[str, Any]) -> dict[str, Any]:
    """In each rank: build every bundle, time alternating rounds, then measure state held."""
    config = LlamaConfig(vocab_size=8192, hidden_size=args["hidden"], num_hidden_layers=args["layers"],
                         intermediate_size=args["hidden"] * 8 // 3 // 64 * 64,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    env = sw.detect()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=gen)
    bundles, optimizers, estimates = {}, {}, {}
    for name, parts in PIPELINES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        est = sw.estimate_memory(model, parts(), env, optimizer=optimizer)
        estimates[name] = est.params_bytes + est.grads_bytes + est.optimizer_bytes
        bundles[name] = sw.pipeline(env, *parts())(model, optimizer)
        optimizers[name] = optimizer
    data_ranks = {name: 1 if "tensor" in name else env.world_size for name in PIPELINES}
    times: dict[str, list[float]] = {name: [] for name in PIPELINES}
    states = {name: b.init() for name, b in bundles.items()}
    for round_ in range(args["rounds"] + 1):  # round 0 warms up
        for name, bundle in bundles.items():
            share = GLOBAL_BATCH // data_ranks[name]
            start = (env.rank % data_ranks[name]) * share
            mine = ids[start:start + share].to(env.device)
            batch = {"input_ids": mine, "labels": mine}
            began = time.perf_counter()
            for _ in range(args["steps"]):
                states[name], out = bundle.step(states[name], batch)
            states[name] = bundle.check(states[name])
            if round_:
                times[name].append((time.perf_counter() - began) / args["steps"] * 1000)
    held = {}
    for name, bundle in bundles.items():
        batch = {"input_ids": ids[:2].to(env.device), "labels": ids[:2].to(env.device)}
        bundle.model(**batch).loss.backward()
        held[name] = _held(bundle, optimizers[name])
        optimizers[name].zero_grad(set_to_none=True)
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return {"rank": env.rank, "params": params, "times": times, "held": held,
            "estimates": estimates}


def table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    base = statistics.median(first["times"]["shard (FSDP2)"])
    lines = [f"Llama {first['params'] / 1e6:.1f}M parameters, global batch {GLOBAL_BATCH} x "
             f"{SEQ} tokens, AdamW, 2 ranks",
             "| pipeline | ms/step (median, min-max) | / shard | state held MiB (rank 0) | "
             "estimated MiB |", "|---|---|---|---|---|"]
    for name in PIPELINES:
        samples = [t for row in rows for t in row["times"][name]]
        median = statistics.median(samples)
        lines.append(f"| {name} | {median:.1f} ({min(samples):.1f}-{max(samples):.1f}) | "
                     f"{median / base:.2f} | {first['held'][name] / MIB:.1f} | "
                     f"{first['estimates'][name] / MIB:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    args = vars(parser.parse_args())
    print(table(run_distributed(run, args, world_size=2, timeout=1800)))


if __name__ == "__main__":
    main()
