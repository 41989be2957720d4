# `shardwise to-hf`: a sharded sw.save checkpoint into Hugging Face safetensors, offline, in one process.
"""The ``to-hf`` subcommand."""

from __future__ import annotations

import argparse

HELP = ("write the model of an sw.save checkpoint (sharded over any number of ranks) as "
        "Hugging Face safetensors, in one process, one output file in memory at a time")


def register(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the output folder, and what to write beside the weights."""
    parser.add_argument("checkpoint", help="a step_N folder sw.save wrote")
    parser.add_argument("out", help="the output folder (published whole)")
    parser.add_argument("--config", default=None,
                        help="a Transformers model folder whose config.json to copy beside")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast floating-point tensors (default: as saved)")
    parser.add_argument("--max_shard_size", type=int, default=5 * 10**9,
                        help="the largest output file in bytes (default 5 GB); also what "
                        "is held in memory at once")


def run(args: argparse.Namespace) -> int:
    import torch

    from shardwise.checkpoint.to_hf import checkpoint_to_hf
    from shardwise.errors import ArgumentError

    if args.max_shard_size < 1:
        raise ArgumentError(f"--max_shard_size must be a positive number of bytes (got "
                            f"{args.max_shard_size})")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             None: None}[args.dtype]
    out = checkpoint_to_hf(args.checkpoint, args.out, config=args.config, dtype=dtype,
                           max_shard_size=args.max_shard_size)
    print(f"wrote {out}")
    return 0
