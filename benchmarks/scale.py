# Per-rank state of Llama-7B/70B shapes sharded over 8 to 1024 simulated ranks, beside estimate_memory.
"""Parameters, gradients and optimizer state one rank holds under ``shard()`` (FSDP and
HSDP) at world sizes this machine cannot run, simulated in one process, against
``sw.estimate_memory`` for the same pipeline and env.

Simulated: the model is built on the meta device (nothing allocated), torch's fake process
group stands in for ``world_size`` ranks (this process is one of them: rank 0, which holds
the largest shards, or with ``--rank last`` the last rank), and the real ``sw.pipeline``
with ``sw.shard()`` applies FSDP2's ``fully_shard`` block by block. Each parameter then is
a DTensor whose local shard is this rank's; its gradient is a zero tensor of the same
shard (what FSDP2's reduce-scatter leaves), and one AdamW step creates the optimizer state
for each shard. Bytes are counted from the local shards (``DTensor.to_local()``), plus the
buffers FSDP2 leaves whole. HSDP: ``shard(replicate_across_nodes=True)`` with 8 ranks per
node, a (nodes x 8) mesh.

Real: a tiny Llama (dims that do not divide evenly, so shards differ) trained for one step
on 2 gloo ranks; its state is counted after the step and one more backward (parameters,
gradients and optimizer state all held at once), as ``memory_table.py`` does.

    OMP_NUM_THREADS=1 python benchmarks/scale.py [--sizes 8 64 256 1024] [--models 7B 70B 405B]
        [--tp 8] [--context 8] [--pipeline 8] [--pipeline-tp 1 8] [--experts 16]
        [--experts-pp 1 4] [--rank first|last] [--no-real] [--json]

Tensor parallel rows (``--tp 8``): ``tensor_parallel(size=8)`` (the model's own plan) then
``shard()`` over the ``dp_shard`` dimension of a ``dp_shard x tp`` mesh, e.g. Llama-70B at
tp=8 x dp_shard=128 on 1024 ranks.

Pipeline parallel rows (``--pipeline 8``, the default, with ``--pipeline-tp 1 8``):
Llama-3.1-405B's shapes under ``pipeline_parallel(size=8)`` (+ ``tensor_parallel(size=8)``)
+ ``shard()`` + bf16 on 1024 simulated ranks (dp_shard 128 x pp 8, and dp_shard 16 x pp 8 x
tp 8): the rank the estimate names as needing the most (its stages' state, split and
sharded, and the parameters they gather for compute), simulated, beside the estimate.

Expert parallel rows (``--experts 16``, the default, with ``--experts-pp 1 4``): Qwen3-235B-A22B's
shapes (94 layers of 128 experts, top-8) under ``expert_parallel(size=16)`` + ``shard()`` + bf16
(+ ``pipeline_parallel(size=4)``) on 256 simulated ranks: each rank holds 1/16 of every expert
stack, which FSDP2 shards again across the 16 (or 4) replica groups, and 1/256 (1/64 of its
stages') of the other weights: the rank the estimate names, simulated, beside the estimate.

Context parallel rows (``--context 8``, the default): Llama-3.1-8B's shapes under
``context_parallel(size=8)`` + ``shard()`` + bf16 + activation checkpointing on 8 simulated
ranks: the state rank 0 holds beside the estimate, and the estimated activations of one
131,072-token sequence, whole and per rank.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw
from shardwise.testing import run_distributed

MIB = 2**20
NODE = 8  # ranks per node under HSDP
SHAPES = {
    "7B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, intermediate_size=28672, vocab_size=32000),
    # Llama-3.1-8B's shapes (the context-parallel rows)
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    # Llama-3.1-405B's shapes
    "405B": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, intermediate_size=53248, vocab_size=128256),
    # the real 2-rank run: odd dims, so the two ranks' shards differ and FSDP2 pads
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=171, vocab_size=251),
}
PARTS = ("params", "grads", "optimizer")


def llama(shape: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))


def qwen3_235b() -> torch.nn.Module:
    """Qwen3-235B-A22B's shapes: 94 layers, each 128 experts (top-8) of 1536 wide."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False))


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters (and buffers), gradients and optimizer state."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(map(local_bytes, params)) + sum(map(local_bytes, model.buffers())),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(map(local_bytes, state))}


def estimated(model: torch.nn.Module, parts: list[sw.Transform], env: sw.Env,
              optimizer: torch.optim.Optimizer) -> dict[str, int]:
    est = sw.estimate_memory(model, parts, env, optimizer=optimizer)
    return {"params": est.params_bytes, "grads": est.grads_bytes,
            "optimizer": est.optimizer_bytes}


def simulate(shape: str, world: int, hsdp: bool, last: bool,
             own_mesh: bool = False, tp: int = 1) -> dict[str, Any]:
    """One rank of a ``world``-rank job under shard() (HSDP: NODE ranks per node, or the
    same 2-D mesh passed as ``shard(mesh=...)`` with ``own_mesh``; with ``tp`` > 1
    tensor_parallel(size=tp) on a dp_shard x tp mesh), on meta."""
    local = NODE if hsdp else world
    rank = world - 1 if last else 0
    env = sw.Env(world_size=world, rank=rank, local_rank=rank % local, local_world_size=local,
                 node_rank=rank // local, num_nodes=world // local, backend="fake")
    with torch.device("meta"):
        model = llama(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        shard = (sw.shard(mesh=init_device_mesh("cpu", (world // NODE, NODE),
                                                mesh_dim_names=("replicate", "shard")))
                 if own_mesh else sw.shard(replicate_across_nodes=hsdp))
        parts = [shard, sw.mixed_precision("bf16")]
        if tp > 1:  # HSDP: dp_replicate (nodes) x dp_shard x tp, a 3-D mesh
            parts.append(sw.tensor_parallel(size=tp))
        estimate = estimated(model, parts, env, optimizer)  # before sharding: the user's model
        bundle = sw.pipeline(env, *parts)(model, optimizer)
        for p in bundle.model.parameters():
            p.grad = torch.zeros_like(p)  # the sharded gradient the reduce-scatter leaves
        optimizer.step()  # AdamW's state for each shard, on the meta device
        simulated = held(bundle.model, optimizer)
    finally:
        dist.destroy_process_group()
    mesh = (f"HSDP {world // NODE}x{NODE}" + (" (mesh=)" if own_mesh else "")) if hsdp \
        else f"FSDP {world}"
    if tp > 1:
        mesh = (f"dp_replicate {world // NODE} x dp_shard {NODE // tp} x tp {tp}" if hsdp
                else f"dp_shard {world // tp} x tp {tp}")
    return {"model": f"Llama-{shape}", "ranks": world, "rank": rank, "mesh": mesh,
            "simulated": simulated, "estimate": estimate}


def held_after_step(env: sw.Env, parts: list[sw.Transform], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What rank ``env.rank`` of a fake process group holds once ``parts`` are applied to the
    meta ``model``: its shards, a zero gradient for each, and one AdamW step's state."""
    dist.init_process_group("fake", rank=env.rank, world_size=env.world_size, store=FakeStore())
    try:
        bundle = sw.pipeline(env, *parts)(model, optimizer)
        for p in bundle.model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return held(bundle.model, optimizer)
    finally:
        dist.destroy_process_group()


def simulate_context(shape: str, world: int, cp: int, tokens: int) -> dict[str, Any]:
    """Rank 0 of ``world`` ranks under context_parallel(size=cp) + shard() on meta: the state
    it holds beside the estimate, and the estimate's activations for one sequence of
    ``tokens`` tokens (bf16, activation checkpointing) whole and per rank."""
    env = sw.Env(world_size=world, rank=0, local_rank=0, local_world_size=min(world, NODE),
                 num_nodes=max(1, world // NODE), backend="fake")
    with torch.device("meta"):
        model = llama(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {"input_ids": torch.zeros(1, tokens, dtype=torch.long, device="meta"),
             "labels": torch.zeros(1, tokens, dtype=torch.long, device="meta")}
    base = [sw.shard(), sw.mixed_precision("bf16"), sw.checkpoint_activations()]
    whole = sw.estimate_memory(model, base, env, batch=batch, optimizer=optimizer)
    parts = [sw.context_parallel(size=cp), *base]
    split = sw.estimate_memory(model, parts, env, batch=batch, optimizer=optimizer)
    simulated = held_after_step(env, parts, model, optimizer)
    return {"model": f"Llama-{shape}", "ranks": world, "tokens": tokens,
            "mesh": f"dp_shard {world // cp} x cp {cp}", "simulated": simulated,
            "estimate": {"params": split.params_bytes, "grads": split.grads_bytes,
                         "optimizer": split.optimizer_bytes},
            "activations_whole": whole.activations_bytes,
            "activations_rank": split.activations_bytes, "layout": split.layout}


def fake_env(world: int, rank: int) -> sw.Env:
    """Rank ``rank`` of ``world`` fake ranks, NODE a node."""
    return sw.Env(world_size=world, rank=rank, local_rank=rank % NODE, local_world_size=NODE,
                  node_rank=rank // NODE, num_nodes=world // NODE, backend="fake")


def simulate_pipeline(shape: str, world: int, pp: int, schedule: str, tp: int = 1
                      ) -> dict[str, Any]:
    """The rank the estimate names as needing the most (parameters, gradients, optimizer state
    and the parameters gathered for compute) under pipeline_parallel(size=pp) (+
    tensor_parallel(size=tp)) + shard() + bf16 on meta, in data rank 0's pipeline group (its
    first tensor-parallel rank): the state it holds beside the estimate's."""
    parts = [sw.pipeline_parallel(size=pp, schedule=schedule), sw.shard(),
             sw.mixed_precision("bf16")]
    if tp > 1:
        parts.append(sw.tensor_parallel(size=tp))

    with torch.device("meta"):
        model = llama(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    found = sw.estimate_memory(model, parts, fake_env(world, 0), optimizer=optimizer)
    # "... rank 7 needs the most": its place in the pipeline group, whose ranks are tp apart
    rank = int(found.layout.split("rank ", 1)[1].split(" ", 1)[0]) * tp
    simulated = held_after_step(fake_env(world, rank), parts, model, optimizer)
    mesh = f"dp_shard {world // (pp * tp)} x pp {pp}" + (f" x tp {tp}" if tp > 1 else "")
    return {"model": f"Llama-{shape}", "ranks": world, "rank": rank,
            "mesh": f"{mesh} ({schedule})", "simulated": simulated,
            "estimate": {"params": found.params_bytes, "grads": found.grads_bytes,
                         "optimizer": found.optimizer_bytes}, "layout": found.layout}


def simulate_experts(world: int, ep: int, pp: int) -> dict[str, Any]:
    """The rank the estimate names as needing the most under expert_parallel(size=ep) +
    shard() + bf16 (+ pipeline_parallel(size=pp)) over Qwen3-235B-A22B's shapes on meta:
    the state it holds beside the estimate's."""
    parts = [sw.expert_parallel(size=ep), sw.shard(), sw.mixed_precision("bf16")]
    if pp > 1:
        parts.append(sw.pipeline_parallel(size=pp))

    with torch.device("meta"):
        model = qwen3_235b()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    found = sw.estimate_memory(model, parts, fake_env(world, 0), optimizer=optimizer)
    # under pp "... rank R needs the most": its place in data rank 0's pipeline group
    rank = int(found.layout.split("rank ", 1)[1].split(" ", 1)[0]) if pp > 1 else 0
    simulated = held_after_step(fake_env(world, rank), parts, model, optimizer)
    data = world // pp
    mesh = (f"dp_shard {data}" + (f" x pp {pp}" if pp > 1 else "")
            + f"; ep {ep} x {data // ep} replicas")
    return {"model": "Qwen3-235B-A22B", "ranks": world, "rank": rank, "mesh": mesh,
            "simulated": simulated, "layout": found.layout,
            "estimate": {"params": found.params_bytes, "grads": found.grads_bytes,
                         "optimizer": found.optimizer_bytes}}


def context_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | tokens | ranks | mesh | params / grads / optimizer MiB (held) | "
             "estimate MiB | activations MiB, whole sequence | per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        sim = row["simulated"]
        lines.append(f"| {row['model']} | {row['tokens']} | {row['ranks']} | {row['mesh']} | "
                     + " / ".join(mib(sim[p]) for p in PARTS)
                     + f" | {mib(sum(row['estimate'].values()))} | "
                     f"{mib(row['activations_whole'])} | {mib(row['activations_rank'])} |")
    return "\n".join(lines)


def two_ranks() -> dict[str, Any]:
    """Run in each of 2 gloo ranks: one step of the tiny Llama under shard(), then a backward."""
    torch.manual_seed(0)
    model = llama("tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    env, parts = sw.detect(), [sw.shard()]
    estimate = estimated(model, parts, env, optimizer)
    bundle = sw.pipeline(env, *parts)(model, optimizer)
    ids = torch.randint(0, SHAPES["tiny"]["vocab_size"], (4, 32),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    state, _ = bundle.step(bundle.init(), batch)
    bundle.model(**batch).loss.backward()  # gradients held again, beside the optimizer state
    return {"model": "Llama-tiny (real, gloo)", "ranks": env.world_size, "rank": env.rank,
            "mesh": f"FSDP {env.world_size}", "simulated": held(bundle.model, optimizer),
            "estimate": estimate}


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """estimate / held, for each part and for their sum."""
    sim, est = row["simulated"], row["estimate"]
    out = {part: est[part] / sim[part] for part in PARTS}
    out["total"] = sum(est.values()) / sum(sim.values())
    return out


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:,.2f}" if nbytes >= MIB else f"{nbytes / MIB:.4f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | ranks | mesh | rank | params MiB | grads MiB | optimizer MiB | "
             "estimate MiB | estimate / held (p / g / o) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        sim, r = row["simulated"], ratios(row)
        lines.append(
            f"| {row['model']} | {row['ranks']} | {row['mesh']} | {row['rank']} | "
            + " | ".join(mib(sim[p]) for p in PARTS)
            + f" | {mib(sum(row['estimate'].values()))} | {r['total']:.4f} "
            f"({r['params']:.4f} / {r['grads']:.4f} / {r['optimizer']:.4f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 64, 256, 1024],
                        help="world sizes of the Llama rows (none: --sizes)")
    parser.add_argument("--models", nargs="+", choices=["7B", "70B", "405B"],
                        default=["7B", "70B"])
    parser.add_argument("--tp", type=int, nargs="*", default=[],
                        help="also tensor_parallel(size=T) x shard() rows (e.g. --tp 8); "
                             "405B runs only these")
    parser.add_argument("--rank", choices=["first", "last"], default="first",
                        help="the rank simulated: first (largest shards) or last")
    parser.add_argument("--no-hsdp", action="store_true", help="FSDP only")
    parser.add_argument("--own-mesh", action="store_true",
                        help="also HSDP through shard(mesh=<a 2-D DeviceMesh>)")
    parser.add_argument("--no-real", action="store_true", help="skip the real 2-rank run")
    parser.add_argument("--context", type=int, nargs="*", default=[8],
                        help="context_parallel(size=C) rows: Llama-8B, 131072 tokens, C ranks "
                             "(none: --context)")
    parser.add_argument("--pipeline", type=int, nargs="*", default=[8],
                        help="pipeline_parallel(size=P) x shard() rows: Llama-405B on 1024 "
                             "ranks, the busiest stage's rank (none: --pipeline)")
    parser.add_argument("--pipeline-tp", type=int, nargs="+", default=[1, 8],
                        help="each pipeline row also with tensor_parallel(size=T) (1: without)")
    parser.add_argument("--pipeline-model", default="405B", choices=list(SHAPES))
    parser.add_argument("--pipeline-ranks", type=int, default=1024)
    parser.add_argument("--experts", type=int, nargs="*", default=[16],
                        help="expert_parallel(size=E) x shard() rows: Qwen3-235B-A22B on "
                             "--experts-ranks ranks (none: --experts)")
    parser.add_argument("--experts-pp", type=int, nargs="+", default=[1, 4],
                        help="each expert row also with pipeline_parallel(size=P) (1: without)")
    parser.add_argument("--experts-ranks", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.models:
        for world in args.sizes:
            for tp in args.tp:
                if world > tp and world % tp == 0:
                    rows.append(simulate(shape, world, hsdp=False, last=args.rank == "last",
                                         tp=tp))
                if not args.no_hsdp and tp < NODE and NODE % tp == 0 and world > NODE \
                        and world % NODE == 0:
                    rows.append(simulate(shape, world, hsdp=True, last=args.rank == "last",
                                         tp=tp))
            if shape == "405B":
                continue
            rows.append(simulate(shape, world, hsdp=False, last=args.rank == "last"))
            if not args.no_hsdp and world > NODE and world % NODE == 0:
                rows.append(simulate(shape, world, hsdp=True, last=args.rank == "last"))
                if args.own_mesh:
                    rows.append(simulate(shape, world, hsdp=True, last=args.rank == "last",
                                         own_mesh=True))
    if not args.no_real:
        rows += run_distributed(two_ranks, world_size=2, timeout=300)
    context = [simulate_context("8B", cp, cp, 131072) for cp in args.context]
    rows += [simulate_pipeline(args.pipeline_model, args.pipeline_ranks, pp, "1F1B", tp)
             for pp in args.pipeline for tp in args.pipeline_tp]
    rows += [simulate_experts(args.experts_ranks, ep, pp)
             for ep in args.experts for pp in args.experts_pp]
    if args.json:
        print(json.dumps(rows + context))
        return
    print(table(rows))
    if context:
        print()
        print(context_table(context))


if __name__ == "__main__":
    main()
