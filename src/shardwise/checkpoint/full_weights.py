# export(): the full model gathered to rank 0 and written as safetensors with clean names.
"""Export a trained model for inference or the Hugging Face ecosystem."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardwise._params import clean_name
from shardwise.bundle import Bundle
from shardwise.distributed import all_agree
from shardwise.engines import Engine
from shardwise.errors import CheckpointError

__all__ = ["export"]

WEIGHTS = "model.safetensors"


def _gathered(model: torch.nn.Module, engine: Engine, main: bool,
              dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The full state dict on the main rank, one tensor at a time (others get nothing)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in engine.full_state(model):  # a collective per tensor when sharded
        if not main:
            continue
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[clean_name(name)] = tensor
    return out


def _from_stages(tensors: dict[str, torch.Tensor], bundle: Bundle) -> dict[str, torch.Tensor]:
    """Under ``pipeline_parallel``: every stage's tensors on the main rank (each rank holds
    its stages' part of the model), in the order of the stages; the others get nothing."""
    import torch.distributed as dist

    stages = bundle.stages
    if stages is None:
        return tensors
    main = dist.get_global_rank(stages.group, 0)
    parts: list[Any] = [None] * stages.size if bundle.env.rank == main else []
    dist.gather_object(tensors, parts if bundle.env.rank == main else None, dst=main,
                       group=stages.group)
    if bundle.env.rank != main:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies for tensors that share memory (tied weights): safetensors stores each once."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        out[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.add((key[0], int(key[1])))
    return out


def _write_config(model: torch.nn.Module, out: Path) -> None:
    """``config.json``, and ``generation_config.json`` when the model has one (Transformers),
    so ``from_pretrained`` and ``generate`` read the directory as they expect."""
    config: Any = getattr(model, "config", None)
    if config is not None:
        if hasattr(config, "save_pretrained"):  # a Transformers PretrainedConfig
            config.save_pretrained(out)
        elif hasattr(config, "to_dict"):
            (out / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    generation: Any = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(out)


def export(path: str | os.PathLike[str], bundle: Bundle, *,
           dtype: torch.dtype | None = None) -> Path:
    """Write ``bundle.model``'s full state as ``path/model.safetensors``; every rank calls it.

    Sharded parameters are gathered one at a time and kept on rank 0's CPU only (pipeline
    stages send their parts to it); names
    carry no wrapper prefixes, so ``model.load_state_dict(..., strict=True)`` on the plain
    model works. A model with a ``config`` (Transformers) also gets ``config.json`` (and
    ``generation_config.json`` when it has one), so ``from_pretrained(path)`` reads the
    directory and ``generate`` uses the same settings.

    Args:
        path: the output directory.
        bundle: the trained bundle.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).

    Returns:
        The output directory.

    Raises:
        CheckpointError: the directory cannot be written.

    Example:
        >>> sw.export("out/final", bundle, dtype=torch.bfloat16)
    """
    env, out = bundle.env, Path(path)
    bundle.engine.synchronise_replicas(bundle.model, bundle.optimizer)  # local SGD: one model
    # a pipeline stage keeps its own part, sent to the main rank below
    tensors = _gathered(bundle.model, bundle.engine, env.is_main or bundle.stages is not None,
                        dtype)
    tensors = _from_stages(tensors, bundle)
    problem = ""
    if env.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / f".{WEIGHTS}.tmp"
            save_file(_unshared(tensors), str(tmp), metadata={"format": "pt"})
            os.replace(tmp, out / WEIGHTS)  # an earlier export stays whole until then
            _write_config(bundle.engine.unwrap(bundle.model), out)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    if not all_agree(env, not problem):  # every rank learns how it went
        problem = problem or "on rank 0"
    if problem:
        raise CheckpointError(f"cannot write the export to {out}: {problem}")
    return out
