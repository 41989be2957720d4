# export(): Hugging Face safetensors written from every rank's shards, published whole (DeepSpeed: gathered).
"""Export a trained model for inference or the Hugging Face ecosystem."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardwise._params import clean_name
from shardwise.bundle import Bundle
from shardwise.checkpoint.hf_files import (
    HF_INDEX,
    HF_WEIGHTS,
    MAX_FILE_BYTES,
    export_state,
    read_hf_files,
    write_hf_files,
)
from shardwise.checkpoint.layout import fsync_dir
from shardwise.checkpoint.transaction import describe_os_error, real_dir
from shardwise.distributed import all_agree
from shardwise.engines import Engine
from shardwise.errors import ArgumentError, CheckpointError

__all__ = ["export", "load_pretrained"]


def _write_gathered(bundle: Bundle, out: Path, dtype: torch.dtype | None) -> None:
    """The gather path (DeepSpeed's engine): every tensor whole on the main rank, written
    there as one ``model.safetensors``."""
    tensors = _gathered(bundle.model, bundle.engine,
                        bundle.env.is_main or bundle.stages is not None, dtype)
    tensors = _from_stages(tensors, bundle)
    if bundle.env.is_main:
        save_file(_unshared(tensors), str(out / HF_WEIGHTS), metadata={"format": "pt"})


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


def _weights_file(name: str) -> bool:
    """Whether a file of an export folder holds weights of the export it replaces (never
    kept beside new weights; every other file is the user's, a tokenizer, a README, or a
    config the new export does not write, and is kept)."""
    return name in (HF_WEIGHTS, HF_INDEX) or \
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None


def _remove(path: Path) -> None:
    """Remove a folder this module left (a symlink by that name is only unlinked)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def prepare_folder(out: Path, tmp: Path, aside: Path) -> None:
    """Put back what a crash between the two renames of a publish left, clear a stale
    staging folder, and make ``tmp`` empty.

    Raises:
        CheckpointError: ``out`` is a symlink or not a folder.
    """
    if out.is_symlink():
        raise CheckpointError(f"the export folder {out} is a symlink; sw.export writes a real "
                              "folder and never follows one: pass its target")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"the export folder {out} is a file; pass a folder")
    if real_dir(aside):
        if out.exists():
            shutil.rmtree(aside)  # the new export was published: the old one was left
        else:
            os.replace(aside, out)  # a crash between the renames: the old export back
    _remove(tmp)
    tmp.mkdir(parents=True)


def publish_folder(tmp: Path, out: Path, aside: Path) -> None:
    """Put the folder ``tmp`` under the name ``out`` whole: the user's own files of an
    earlier ``out`` linked in first, then two renames (the old folder set aside, the new one
    in), then the old one removed; :func:`prepare_folder` finishes a publish a crash cut."""
    if out.exists():
        for entry in out.iterdir():
            if _weights_file(entry.name) or (tmp / entry.name).exists():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link)
            else:
                _link(entry, tmp / entry.name)
        fsync_dir(tmp)
        os.replace(out, aside)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def _link(source: Any, target: Any) -> None:
    """A hard link (the file is not copied), or a copy where the file system has none."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def export(path: str | os.PathLike[str], bundle: Bundle, *, dtype: torch.dtype | None = None,
           max_shard_size: int = MAX_FILE_BYTES) -> Path:
    """Write ``bundle.model`` as Hugging Face safetensors in the folder ``path``; every rank
    calls it.

    No rank gathers the model: each writes what it holds (its FSDP2 shards, tensor-parallel
    parts, pipeline stages; a replicated tensor once, by one rank), then the ranks
    consolidate the output files between them, one tensor at a time (torch's DCP
    ``HuggingFaceStorageWriter``). The folder holds what ``save_pretrained`` writes:
    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files of at most
    ``max_shard_size`` bytes with ``model.safetensors.index.json``; a tensor under two names
    (tied embeddings) once, under the first; names without wrapper prefixes (a plain
    ``load_state_dict`` works); a model with a ``config`` (Transformers) also gets
    ``config.json`` (and ``generation_config.json``), so ``from_pretrained(path)`` reads it.
    The folder is published whole or not at all: written beside it, then renamed in; an
    earlier export under the name is replaced, files of the user's in it (a tokenizer) are
    kept. A model under DeepSpeed's engine is gathered to rank 0 (its partitions are
    DeepSpeed's own).

    Args:
        path: the output folder (never a symlink).
        bundle: the trained bundle.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).
        max_shard_size: the largest file in bytes (Transformers' default, 5 GB); a model
            larger is written as several files, each consolidated by one rank in turn.

    Returns:
        The output folder.

    Raises:
        CheckpointError: the folder cannot be written, or is a symlink or a file.

    Example:
        >>> sw.export("out/final", bundle, dtype=torch.bfloat16)
    """
    if not isinstance(max_shard_size, int) or isinstance(max_shard_size, bool) or \
            max_shard_size < 1:
        raise ArgumentError(f"export() 'max_shard_size' must be a positive number of bytes "
                            f"(got {max_shard_size!r})")
    env, out = bundle.env, Path(path)
    bundle.engine.synchronise_replicas(bundle.model, bundle.optimizer)  # local SGD: one model
    tmp = out.parent / f".{out.name}.export.tmp"
    aside = out.parent / f".{out.name}.export.old"
    problem = ""
    if env.is_main:
        try:
            prepare_folder(out, tmp, aside)
        except (OSError, CheckpointError) as exc:
            problem = str(exc) if isinstance(exc, CheckpointError) else describe_os_error(exc)
    if not all_agree(env, not problem):
        raise CheckpointError(problem or "sw.export: rank 0 could not prepare the folder (its "
                              "error names why)")
    module = bundle.engine.unwrap(bundle.model)
    try:
        if bundle.engine.exports_in_place:  # every rank raises alike if any step failed
            write_hf_files(env, export_state(module, dtype), tmp, max_shard_size)
        else:
            _write_gathered(bundle, tmp, dtype)
    except CheckpointError as exc:
        problem = str(exc)
    except OSError as exc:  # the gathered file, written by rank 0 alone
        problem = describe_os_error(exc)
    except Exception as exc:  # safetensors' own errors too: every rank must hear of it
        problem = f"{type(exc).__name__}: {exc}"
    if env.is_main and not problem:
        try:
            _write_config(module, tmp)
            fsync_dir(tmp)
            publish_folder(tmp, out, aside)
        except OSError as exc:
            problem = describe_os_error(exc)
        except Exception as exc:  # a config that cannot be written: every rank must hear
            problem = f"{type(exc).__name__}: {exc}"
    if not all_agree(env, not problem):  # every rank learns how it went
        problem = problem or "on another rank (its error names why)"
    if problem:
        if env.is_main:
            _remove(tmp)
        raise CheckpointError(f"cannot write the export to {out}: {problem}")
    return out


def load_pretrained(path: str | os.PathLike[str], bundle: Bundle) -> Bundle:
    """Read Hugging Face safetensors (what ``save_pretrained`` or :func:`export` wrote: one
    ``model.safetensors`` or indexed files) into the bundle's model, each rank reading only
    the slices it holds: its FSDP2 shards, its tensor-parallel parts, its pipeline stages'
    tensors. No rank reads the whole model; every rank calls it. Values are cast to the
    model's dtypes; a tied weight is read once, under the name the files give it.

    Args:
        path: the folder of the files.
        bundle: the bundle to load into (after the pipeline has sharded the model).

    Returns:
        ``bundle`` (its model loaded in place).

    Raises:
        CheckpointError: no such folder, or files that do not fit the model (a tensor
            missing or of another shape, named).

    Example:
        >>> bundle = sw.pipeline(sw.shard())(LlamaForCausalLM(config), optimizer)
        >>> sw.load_pretrained("meta-llama/local-copy", bundle)
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"sw.load_pretrained: {folder} is not a folder of safetensors "
                              "files")
    module = bundle.engine.unwrap(bundle.model)
    with torch.no_grad():
        read_hf_files(bundle.env, export_state(module, None), folder)
    return bundle
