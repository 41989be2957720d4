# `shardwise estimate-memory`: the per-rank memory table for a model, built without weights.
"""The ``estimate-memory`` subcommand."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

HELP = ("per-rank memory of replicate / shard / + offload / + checkpointing for a model "
        "(a Transformers config.json or package.module:factory), on the meta device")


def register(parser: argparse.ArgumentParser) -> None:
    """The model, the world sizes, precisions and a sample batch shape."""
    parser.add_argument("model", help="a Transformers config.json (or its directory), or "
                        "package.module:factory returning an nn.Module")
    parser.add_argument("--world_sizes", default="1,2,8", help="comma-separated (1,2,8)")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated")
    parser.add_argument("--batch_size", type=int, default=1, help="per rank")
    parser.add_argument("--seq_len", type=int, default=512)


def build_model(spec: str) -> Any:
    """The model on the meta device: no weights are allocated."""
    import torch

    with torch.device("meta"):
        if ":" in spec and not Path(spec).exists():
            module, _, name = spec.partition(":")
            return getattr(importlib.import_module(module), name)()
        path = Path(spec)
        path = path / "config.json" if path.is_dir() else path
        try:
            import transformers
        except ImportError:
            raise SystemExit("a config.json needs the transformers package; pass "
                             "package.module:factory instead") from None
        config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        return transformers.AutoModelForCausalLM.from_config(config)


def run(args: argparse.Namespace) -> int:
    """Print one table row per world size, precision and layout."""
    import torch

    import shardwise as sw

    model = build_model(args.model)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    batch = {"input_ids": ids, "labels": ids} if vocab else None
    layouts: dict[str, list[sw.Transform]] = {
               "replicate": [sw.replicate()], "shard": [sw.shard()],
               "shard + offload": [sw.shard(), sw.offload()],
               "shard + checkpointing": [sw.shard(), sw.checkpoint_activations()],
               "shard + ckpt + offload": [sw.shard(), sw.checkpoint_activations(), sw.offload()]}
    print(f"{type(model).__name__}: {params / 1e6:.1f}M parameters; AdamW; batch "
          f"{args.batch_size}x{args.seq_len} per rank; GiB per rank on an accelerator")
    print(f"{'ranks':>5} {'precision':>9} {'layout':<24}{'params':>8}{'grads':>8}{'optim':>8}"
          f"{'activ.':>8}{'gathered':>9}{'total':>8}")
    gib = 2**30
    for world in (int(w) for w in args.world_sizes.split(",")):
        env = sw.Env(world_size=world, local_world_size=world, device="cuda",
                     precisions=("fp32", "bf16", "fp16"))
        for precision in args.precisions.split(","):
            for name, parts in layouts.items():
                est = sw.estimate_memory(model, [*parts, sw.mixed_precision(precision)], env,
                                         batch=batch)
                act = "n/a" if est.activations_bytes is None else \
                    f"{est.activations_bytes / gib:8.2f}"
                print(f"{world:>5} {precision:>9} {name:<24}{est.params_bytes / gib:8.2f}"
                      f"{est.grads_bytes / gib:8.2f}{est.optimizer_bytes / gib:8.2f}{act:>8}"
                      f"{est.working_bytes / gib:9.2f}{est.total_bytes / gib:8.2f}")
    return 0
