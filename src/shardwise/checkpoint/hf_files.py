# Hugging Face safetensors written by every rank from what it holds, then consolidated by all ranks.
"""The files ``save_pretrained`` writes (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``), written without gathering
the model anywhere.

Each rank hands DCP its own part of the state dict (FSDP2 shards, tensor-parallel parts,
its pipeline stages' tensors; a replicated tensor is written by one rank, DCP's dedup) and
``HuggingFaceStorageWriter`` writes it as sharded safetensors files; then every rank
consolidates its share of the output files (``consolidate_safetensors_files_on_every_rank``:
one whole tensor in memory at a time). The pieces are cut finer than the output files
(DCP holds a piece file's bytes while writing it), so no rank holds more than its shard,
a couple of its pieces and one tensor.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise._params import clean_name

__all__ = ["HF_WEIGHTS", "HF_INDEX", "SHARDED", "export_state", "file_plan", "write_hf_files",
           "read_hf_files", "holds_weights"]

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
#: where the ranks' pieces are written before consolidation (removed after it)
SHARDED = "sharded"
#: the largest output file (as Transformers' default ``max_shard_size``, 5 GB)
MAX_FILE_BYTES = 5 * 10**9
#: files the pieces of the model are cut into before consolidation, per rank
PIECES_PER_RANK = 8


def holds_weights(folder: Path) -> bool:
    """Whether ``folder`` holds Hugging Face weights: ``model.safetensors`` or an index."""
    return (folder / HF_WEIGHTS).is_file() or (folder / HF_INDEX).is_file()


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def export_state(module: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, Any]:
    """``module``'s state dict as this rank holds it (DTensors stay DTensors), under the
    model's own names, floating-point tensors cast to ``dtype``. A tensor under two names
    (tied embeddings) is kept once, under the first, as ``save_pretrained`` writes it."""
    aliases = {name for name, _ in module.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in module.named_parameters()}
    aliases |= {name for name, _ in module.named_buffers(remove_duplicate=False)} - \
        {name for name, _ in module.named_buffers()}
    out: dict[str, Any] = {}
    for name, tensor in module.state_dict().items():
        if name in aliases:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        out[clean_name(name)] = tensor
    return out


def file_plan(sizes: Iterable[tuple[str, int]], files: int) -> dict[str, int]:
    """Each tensor's output file (1..``files``), in the order given: consecutive tensors
    share a file until it holds its share of the bytes, so the files balance; fewer files
    when there are fewer tensors."""
    sizes = list(sizes)
    total = sum(size for _, size in sizes)
    files = max(1, min(files, len(sizes)))
    share = total / files
    plan: dict[str, int] = {}
    index, filled = 1, 0
    for name, size in sizes:
        if filled and filled + size / 2 > share * index and index < files:
            index += 1
        plan[name] = index
        filled += size
    return plan


def global_sizes(state: Mapping[str, Any], group: Any) -> list[tuple[str, int]]:
    """Every tensor's name and whole size in bytes, over all ranks (a pipeline's stages
    hold different names), in rank order then the state dict's: a collective."""
    import torch.distributed as dist

    mine = [(name, _nbytes(tensor)) for name, tensor in state.items()]
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    seen: dict[str, int] = {}
    for part in every:
        for name, size in part:
            seen.setdefault(name, size)
    return list(seen.items())


def write_hf_files(state: dict[str, Any], out: Path, max_file_bytes: int) -> dict[str, int]:
    """Write ``state`` (this rank's part) with every other rank's into ``out`` as Hugging
    Face safetensors, files of at most ``max_file_bytes`` (one tensor larger than that gets
    a file of its own) consolidated by rank ``index % world``; every rank calls it. Returns
    the file plan (name -> file index). ``out`` must exist and be empty; one output file is
    named ``model.safetensors``, as ``save_pretrained`` names it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    sizes = global_sizes(state, None)
    total = sum(size for _, size in sizes)
    plan = file_plan(sizes, max(1, math.ceil(total / max_file_bytes)))
    # the pieces in finer files than the output: DCP holds a piece file's bytes whole
    # while it writes it, so a rank's peak is two of its pieces, not two of its shards
    world = dist.get_world_size() if dist.is_initialized() else 1
    pieces_plan = file_plan(sizes, max(PIECES_PER_RANK * world, max(plan.values(), default=1)))
    pieces = out / SHARDED
    if not dist.is_initialized() or dist.get_rank() == 0:
        pieces.mkdir()
    if dist.is_initialized():
        dist.barrier()
    writer = HuggingFaceStorageWriter(str(pieces), fqn_to_index_mapping=pieces_plan,
                                      save_distributed=True)
    dcp.save(state, storage_writer=writer)
    if dist.is_initialized():  # each rank its share of the output files
        consolidate_safetensors_files_on_every_rank(str(pieces), str(out), plan)
    else:
        consolidate_safetensors_files(str(pieces), str(out), fqn_to_index_mapping=plan)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(pieces)
        if max(plan.values(), default=1) == 1:  # one file: the name save_pretrained gives it
            only = next(out.glob("model-*.safetensors"))
            os.replace(only, out / HF_WEIGHTS)
            (out / HF_INDEX).unlink(missing_ok=True)
    return plan


def read_hf_files(state: dict[str, Any], path: Path) -> None:
    """Copy Hugging Face safetensors at ``path`` into ``state``'s tensors in place (this
    rank's part: a DTensor's local shard, a stage's tensors), each rank reading only the
    slices it holds (DCP's ``HuggingFaceStorageReader``); every rank calls it.

    Raises:
        CheckpointError: a tensor missing from the files or of another shape, named.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from shardwise.errors import CheckpointError

    reader = HuggingFaceStorageReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(name for name in state if name not in stored)
    shapes = sorted(f"{name} {tuple(state[name].shape)} (the files: "
                    f"{tuple(getattr(stored[name], 'size', ()))})" for name in state
                    if name in stored and tuple(getattr(stored[name], "size", ())) !=
                    tuple(state[name].shape))
    if missing or shapes:
        shown = "; ".join([*(f"missing {n}" for n in missing[:5]), *shapes[:5]])
        raise CheckpointError(f"the safetensors files in {path} do not fit the model: {shown}"
                              f"{' ...' if len(missing) + len(shapes) > 5 else ''}")
    dcp.load(state, storage_reader=reader)
