# `shardwise from-hf`: Hugging Face safetensors into a weights-only sw.save checkpoint, offline.
"""The ``from-hf`` subcommand."""

from __future__ import annotations

import argparse

HELP = ("write the Hugging Face safetensors of a model folder as a weights-only sw.save "
        "checkpoint any number of ranks loads, in one process, one tensor in memory at a time")


def register(parser: argparse.ArgumentParser) -> None:
    """The model folder, the checkpoint root, and the checkpoint's name."""
    parser.add_argument("model", help="a folder save_pretrained or sw.export wrote")
    parser.add_argument("directory", help="the checkpoint root (as sw.save's directory)")
    parser.add_argument("--name", default=None,
                        help="a named checkpoint directory/<name> (default: step_00000000, "
                        "which latest names)")


def run(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.from_hf import WEIGHTS_ONLY_SKIP, hf_to_checkpoint

    out = hf_to_checkpoint(args.model, args.directory, name=args.name)
    print(f"wrote {out}; load it with sw.load({str(out)!r}, bundle, "
          f"skip={WEIGHTS_ONLY_SKIP!r})")
    return 0
