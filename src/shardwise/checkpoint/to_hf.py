# A sharded sw.save checkpoint as Hugging Face safetensors, offline, one output file in memory at a time.
"""Convert a checkpoint ``sw.save`` wrote (DCP, sharded over any number of ranks) into the
files ``save_pretrained`` writes, in one process on any machine, never holding the whole
model: the checkpoint is verified (its sealed checksums), then each output file's tensors
are read whole from the shards (DCP reads only those) and written, one file at a time.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from shardwise._params import clean_name
from shardwise.checkpoint.hf_files import MAX_FILE_BYTES, file_plan, hf_file_name, write_hf_index
from shardwise.errors import CheckpointError

__all__ = ["checkpoint_to_hf"]

PREFIX = "model."


def _config_folder(config: str | os.PathLike[str] | None) -> Path | None:
    """The folder of ``config`` (a model folder or its ``config.json``).

    Raises:
        CheckpointError: no ``config.json`` there.
    """
    if config is None:
        return None
    folder = Path(config)
    folder = folder.parent if folder.name == "config.json" else folder
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"--config {config}: no config.json there (pass a Transformers "
                              "model folder or its config.json)")
    return folder


def _read_whole(source: Path, tensors: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors ``keys`` (DCP's keys, ``model.`` first), read whole
    from the shards in this process, under their names without the prefix."""
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint.restore import dcp_quietly
    from shardwise.checkpoint.safe_reader import SafeLoadPlanner, SafeReader

    part = {key[len(PREFIX):]: torch.empty(tuple(tensors[key].size),
                                           dtype=tensors[key].properties.dtype)
            for key in keys}
    with dcp_quietly():
        dcp.load({"model": part}, storage_reader=SafeReader(source),
                 planner=SafeLoadPlanner(), no_dist=True)
    return part


def _tied_aliases(source: Path, tensors: dict[str, Any], settings: Path | None) -> list[str]:
    """The checkpoint keys of the second and later names of each weight the model of
    ``settings/config.json`` ties (the first is written), each checked to hold the same
    values as the first.

    Raises:
        CheckpointError: a tied pair holds different values (not the model the config
            describes).
    """
    if settings is None:
        return []
    from shardwise.checkpoint.from_hf import tied_names

    key_of = {clean_name(key[len(PREFIX):]): key for key in tensors}
    aliases = []
    for names in tied_names(settings):
        keys = [key_of[name] for name in names if name in key_of]
        if len(keys) < 2:
            continue
        first, *rest = _read_whole(source, tensors, keys).values()
        if not all(torch.equal(first, other) for other in rest):
            raise CheckpointError(f"{settings / 'config.json'} ties {', '.join(names)}, but "
                                  f"the checkpoint {source} holds different values for them: "
                                  "it is not of the model that config describes")
        aliases += keys[1:]
    return aliases


def checkpoint_to_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
                     config: str | os.PathLike[str] | None = None,
                     dtype: torch.dtype | None = None,
                     max_shard_size: int = MAX_FILE_BYTES) -> Path:
    """Write the model of the ``sw.save`` checkpoint folder ``checkpoint`` into the folder
    ``out`` as Hugging Face safetensors; ``config``: a Transformers model folder (or its
    ``config.json``) whose ``config.json`` and ``generation_config.json`` are copied beside,
    so ``from_pretrained(out)`` reads it. The folder is published whole (as ``sw.export``).

    Raises:
        CheckpointError: the checkpoint is damaged, partial or not a checkpoint; ``out`` is
            a symlink or a file.
    """
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardwise.checkpoint.full_weights import prepare_folder, publish_folder
    from shardwise.checkpoint.integrity import verify
    from shardwise.checkpoint.safe_reader import SafeReader
    from shardwise.env import Env

    source, target = Path(checkpoint), Path(out)
    settings = _config_folder(config)  # refused before any work
    if not (source / ".metadata").is_file():
        raise CheckpointError(f"{source} is not a checkpoint folder sw.save wrote (no "
                              "DCP .metadata in it); pass a step_N folder")
    verify(source, Env())  # the sealed checksums, before anything is read
    stored = SafeReader(source).read_metadata().state_dict_metadata
    tensors = {key: meta for key, meta in stored.items()
               if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError(f"the checkpoint {source} holds no model tensors")
    for alias in _tied_aliases(source, tensors, settings):
        del tensors[alias]  # save_pretrained writes a tied weight once, from_pretrained ties it

    def size(meta: TensorStorageMetadata) -> int:
        written = dtype if dtype is not None and meta.properties.dtype.is_floating_point \
            else meta.properties.dtype
        element = torch.empty((), dtype=written).element_size()
        return math.prod(meta.size) * element

    sizes = [(key, size(meta)) for key, meta in tensors.items()]
    plan = file_plan(sizes, max(1, math.ceil(sum(s for _, s in sizes) / max_shard_size)),
                     max_shard_size)
    count = max(plan.values())
    tmp = target.parent / f".{target.name}.export.tmp"
    aside = target.parent / f".{target.name}.export.old"
    prepare_folder(target, tmp, aside)
    names: dict[str, int] = {}  # the file plan under the model's names
    for index in range(1, count + 1):
        keys = [key for key, file in plan.items() if file == index]
        part = _read_whole(source, tensors, keys)
        name = hf_file_name(index, count)
        written = {clean_name(k): (v.to(dtype) if dtype is not None and v.is_floating_point()
                                   else v) for k, v in part.items()}
        save_file(written, str(tmp / name), metadata={"format": "pt"})
        names.update({clean_name(key[len(PREFIX):]): file for key, file in plan.items()
                      if file == index})
        del part, written
    write_hf_index(tmp, names, sum(s for _, s in sizes))
    if settings is not None:
        for name in ("config.json", "generation_config.json"):
            if (settings / name).is_file():
                (tmp / name).write_bytes((settings / name).read_bytes())
    publish_folder(tmp, target, aside)
    return target
