# `shardwise estimate-memory`: the per-rank memory table for a model, built without weights.
"""The ``estimate-memory`` subcommand."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from shardwise._text import short

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

    from shardwise.errors import ArgumentError, ConfigError

    if ":" in spec and not Path(spec).exists():
        module, _, name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ArgumentError(f"model {short(spec)}: cannot import {name!r} from {module!r}: "
                                f"{exc}") from None
        with torch.device("meta"):
            return factory()
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    try:
        import transformers
    except ImportError:
        raise ArgumentError("a config.json needs the transformers package; pass "
                            "package.module:factory instead") from None
    from shardwise._config_source import load_source

    if path.suffix != ".json":
        raise ArgumentError(f"model {short(spec)}: accepted: a config.json, its directory, or "
                            "package.module:factory")
    data = dict(load_source(path).data)  # bounded, UTF-8, a mapping, no repeated keys
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{path}: model_type={short(model_type)} is not accepted; accepted: a "
                          "Transformers model type such as 'llama'")
    try:
        config = transformers.AutoConfig.for_model(**data)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # Transformers' own validation errors are of many types
        raise ConfigError(f"{path}: Transformers cannot build a causal LM from it: "
                          f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _sizes(text: str, name: str) -> list[int]:
    """``--world_sizes 1,2,8`` as integers >= 1."""
    from shardwise.errors import ArgumentError

    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and 1 <= int(p) <= 2**20 for p in parts):
        raise ArgumentError(f"--{name} {short(text)} is not accepted; accepted: comma-separated "
                            "integers >= 1, e.g. 1,2,8")
    return [int(p) for p in parts]


def run(args: argparse.Namespace) -> int:
    """Print one table row per world size, precision and layout."""
    import torch

    import shardwise as sw
    from shardwise.errors import ArgumentError
    from shardwise.precision import NAMES

    worlds = _sizes(args.world_sizes, "world_sizes")
    precisions = [p.strip() for p in args.precisions.split(",")]
    if not all(p in NAMES for p in precisions):
        raise ArgumentError(f"--precisions {short(args.precisions)} is not accepted; accepted: "
                            f"comma-separated names from {', '.join(NAMES)}")
    for name in ("batch_size", "seq_len"):
        if not 1 <= getattr(args, name) <= 2**24:
            raise ArgumentError(f"--{name} {getattr(args, name)} is not accepted; accepted: an "
                                "integer in [1, 16777216]")
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
    for world in worlds:
        env = sw.Env(world_size=world, local_world_size=world, device="cuda",
                     precisions=("fp32", "bf16", "fp16"))
        for precision in precisions:
            for name, parts in layouts.items():
                est = sw.estimate_memory(model, [*parts, sw.mixed_precision(precision)], env,
                                         batch=batch)
                act = "n/a" if est.activations_bytes is None else \
                    f"{est.activations_bytes / gib:8.2f}"
                print(f"{world:>5} {precision:>9} {name:<24}{est.params_bytes / gib:8.2f}"
                      f"{est.grads_bytes / gib:8.2f}{est.optimizer_bytes / gib:8.2f}{act:>8}"
                      f"{est.working_bytes / gib:9.2f}{est.total_bytes / gib:8.2f}")
    return 0
