# Hugging Face safetensors written by every rank from what it holds, then consolidated by all ranks.
"""The files ``save_pretrained`` writes (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``), written without gathering
the model anywhere.

Each rank hands DCP its own part of the state dict (FSDP2 shards, tensor-parallel parts,
its pipeline stages' tensors; a replicated tensor is written by one rank, DCP's dedup) and
``HuggingFaceStorageWriter`` writes it as sharded safetensors files; then every rank
consolidates its share of the output files (DCP's ``consolidate_safetensors_files``: one
whole tensor in memory at a time), and every step ends with the ranks agreeing it went
well, so a failure on one rank raises on all of them instead of leaving them waiting.
Integer and bool tensors (a BatchNorm's ``num_batches_tracked``) travel as floats of the
same width (torch's consolidation sizes only floats), scalars as one element (it writes
a scalar as 0); each gets its dtype and shape back in the output file's header. The
pieces are cut finer than the output files (DCP holds a piece file's bytes while writing
it), so no rank holds more than its shard, a couple of its pieces and one tensor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise._params import clean_name
from shardwise.env import Env
from shardwise.errors import CheckpointError

__all__ = ["HF_WEIGHTS", "HF_INDEX", "SHARDED", "agreed", "export_state", "file_plan", "hf_file_name",
           "write_hf_index", "write_hf_files", "weight_files", "read_hf_files", "holds_weights",
           "hf_reader", "stored_tensors"]

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
#: where the ranks' pieces are written before consolidation (removed after it): a hidden
#: name of shardwise's own, never a folder of the user's in the Trainer's output_dir
SHARDED = ".shardwise-pieces"
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
    def names(pairs: Iterable[tuple[str, Any]]) -> set[str]:  # wrappers' prefixes dropped:
        return {clean_name(name) for name, _ in pairs}  # the state dict drops some of them

    aliases = names(module.named_parameters(remove_duplicate=False)) - \
        names(module.named_parameters())
    aliases |= names(module.named_buffers(remove_duplicate=False)) - \
        names(module.named_buffers())
    out: dict[str, Any] = {}
    for name, tensor in module.state_dict().items():
        if clean_name(name) in aliases:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        out[clean_name(name)] = tensor
    return out


def file_plan(sizes: Iterable[tuple[str, int]], files: int,
              limit: int | None = None) -> dict[str, int]:
    """Each tensor's output file (1, 2, ...), in the order given: consecutive tensors share
    a file until it holds its share of ``files``, so the files balance; fewer files when
    there are fewer tensors. With ``limit``, no file grows past ``limit`` bytes (a tensor
    larger than that alone in its file), which may take more files than ``files``."""
    sizes = list(sizes)
    total = sum(size for _, size in sizes)
    files = max(1, min(files, len(sizes)))
    share = total / files
    plan: dict[str, int] = {}
    index, filled, in_file = 1, 0, 0
    for name, size in sizes:
        full = limit is not None and in_file + size > limit
        if in_file and (full or (filled + size / 2 > share * index and index < files)):
            index, in_file = index + 1, 0
        plan[name] = index
        filled += size
        in_file += size
    return plan


def hf_file_name(index: int, count: int) -> str:
    """The name ``save_pretrained`` gives output file ``index`` of ``count``."""
    return HF_WEIGHTS if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def write_hf_index(out: Path, plan: Mapping[str, int], total_size: int) -> None:
    """``model.safetensors.index.json`` for the file plan (name -> file index), as
    ``save_pretrained`` writes it; nothing when the plan has one file."""
    count = max(plan.values(), default=1)
    if count == 1:
        return
    weight_map = {name: hf_file_name(index, count) for name, index in sorted(plan.items())}
    text = json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                      indent=2)
    with open(out / HF_INDEX, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())


#: safetensors' name of each dtype torch's consolidation cannot size (it asks
#: ``torch.finfo``): written as a float of the same width, then renamed in the header
STORED_AS = {torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
             torch.uint32: "U32", torch.uint64: "U64"}
_SAME_WIDTH_FLOAT = {8: torch.float64, 4: torch.float32, 2: torch.float16,
                     1: torch.float8_e4m3fn}


def _header_fix(tensor: Any) -> dict[str, Any]:
    """What the output file's header must say of ``tensor`` that torch's consolidation
    gets wrong: the dtype of an integer or bool tensor (written as a float), the empty
    shape of a scalar (written with shape ``[1]``: consolidation writes a scalar as 0)."""
    fix: dict[str, Any] = {}
    if tensor.dtype in STORED_AS:
        fix["dtype"] = STORED_AS[tensor.dtype]
    if tensor.dim() == 0:
        fix["shape"] = []
    return fix


def _writable(name: str, tensor: Any) -> Any:
    """``tensor`` as torch's consolidation copies it whole (no copy of the data): integer
    and bool tensors seen as floats of the same width, a scalar as one element.

    Raises:
        CheckpointError: a dtype safetensors has no name for (the tensor named).
    """
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.is_floating_point():
        return tensor
    if tensor.dtype not in STORED_AS:
        raise CheckpointError(f"cannot write {name} ({tensor.dtype}) as safetensors: the "
                              f"export writes floating-point tensors and "
                              f"{sorted(str(d) for d in STORED_AS)}")
    return tensor.view(_SAME_WIDTH_FLOAT[tensor.element_size()])


def _fix_header(file: Path, fixes: Mapping[str, Mapping[str, Any]]) -> None:
    """Set the tensors' ``fixes`` (dtype, shape) in the safetensors header of ``file``, in
    place: the bytes are unchanged, the header keeps its length (padded with spaces, as the
    format allows)."""
    with open(file, "r+b") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
        for name, fix in fixes.items():
            header[name].update(fix)
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > length:  # cannot happen: each new value is no longer than the old
            raise CheckpointError(f"cannot fix the header of {file}")
        stream.seek(8)
        stream.write(text + b" " * (length - len(text)))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def global_sizes(state: Mapping[str, Any], group: Any) -> list[tuple[str, int, dict[str, Any]]]:
    """Every tensor's name, whole size in bytes and the header fix torch's consolidation
    needs (:func:`_header_fix`), over all ranks (a pipeline's stages hold different names),
    in rank order then the state dict's: a collective."""
    import torch.distributed as dist

    mine = [(name, _nbytes(tensor), _header_fix(tensor)) for name, tensor in state.items()]
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    seen: dict[str, tuple[int, dict[str, Any]]] = {}
    for part in every:
        for name, size, fix in part:
            seen.setdefault(name, (size, fix))
    return [(name, size, fix) for name, (size, fix) in seen.items()]


def agreed(env: Env, what: str, work: Callable[[], Any]) -> Any:
    """Run this rank's part of a step, then agree: if it failed on any rank, every rank
    raises (no rank is left waiting in a collective the failing one skipped).

    Raises:
        CheckpointError: ``what`` failed here (why) or on another rank.
    """
    from shardwise.checkpoint.transaction import describe_os_error
    from shardwise.distributed import all_agree

    problem, result = "", None
    try:
        result = work()
    except OSError as exc:
        problem = describe_os_error(exc)
    except Exception as exc:  # any failure must reach the agreement, not skip it
        problem = f"{type(exc).__name__}: {exc}"
    if not all_agree(env, not problem):
        raise CheckpointError(f"{what}: {problem}" if problem else
                              f"{what} failed on another rank (its error names why)")
    return result


def _fresh(folder: Path) -> None:
    """Make ``folder`` empty (what a killed write left in it is removed)."""
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()


def _consolidate(pieces: Path, out: Path, plan: Mapping[str, int], rank: int, world: int,
                 fixes: Mapping[str, dict[str, Any]]) -> None:
    """Write this rank's output files (index ``% world == rank``) from the pieces, under the
    names ``save_pretrained`` gives them, their headers fixed (:func:`_header_fix`), each
    file synced. No collective: a failure here reaches the agreement."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    count = max(plan.values())
    mine = sorted({index for index in plan.values() if index % world == rank})
    if not mine:
        return
    scratch = pieces / f"rank{rank}"
    _fresh(scratch)
    local = {index: position + 1 for position, index in enumerate(mine)}
    consolidate_safetensors_files(str(pieces), str(scratch), fqn_to_index_mapping={
        name: local[index] for name, index in plan.items() if index in local})
    written = sorted(scratch.glob("*.safetensors"))  # zero-padded: in the local order
    if len(written) != len(mine):
        raise CheckpointError(f"consolidation wrote {len(written)} files, not {len(mine)}")
    for index, file in zip(mine, written, strict=True):
        fixed = {name: fixes[name] for name, at in plan.items()
                 if at == index and fixes.get(name)}
        if fixed:
            _fix_header(file, fixed)
        _fsync_file(file)
        os.replace(file, out / hf_file_name(index, count))


def write_hf_files(env: Env, state: dict[str, Any], out: Path,
                   max_file_bytes: int) -> dict[str, int]:
    """Write ``state`` (this rank's part) with every other rank's into ``out`` as Hugging
    Face safetensors, files of at most ``max_file_bytes`` (one tensor larger than that gets
    a file of its own) consolidated by rank ``index % world``; every rank calls it. Returns
    the file plan (name -> file index). ``out`` must exist; one output file is named
    ``model.safetensors``, as ``save_pretrained`` names it. Each step ends with every rank
    agreeing it went well, so a failure raises on every rank.

    Raises:
        CheckpointError: no tensors, a tensor of a dtype safetensors has no name for, or a
            step failed on some rank (why, on that rank).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    every = global_sizes(state, None)
    if not every:
        raise CheckpointError("nothing to write: the model holds no tensors")
    sizes = [(name, size) for name, size, _ in every]
    fixes = {name: fix for name, _, fix in every if fix}
    total = sum(size for _, size in sizes)
    plan = file_plan(sizes, max(1, math.ceil(total / max_file_bytes)), max_file_bytes)
    # the pieces in finer files than the output: DCP holds a piece file's bytes whole
    # while it writes it, so a rank's peak is two of its pieces, not two of its shards
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    pieces_plan = file_plan(sizes, max(PIECES_PER_RANK * world, max(plan.values())))
    pieces = out / SHARDED
    agreed(env, f"cannot make {pieces}", lambda: _fresh(pieces) if rank == 0 else None)
    writable = agreed(env, "cannot write the safetensors files",
                       lambda: {name: _writable(name, t) for name, t in state.items()})
    writer = HuggingFaceStorageWriter(str(pieces), fqn_to_index_mapping=pieces_plan,
                                      save_distributed=True)
    agreed(env, f"cannot write the pieces in {pieces}",
            lambda: dcp.save(writable, storage_writer=writer))
    agreed(env, f"cannot consolidate the safetensors files in {out}",
            lambda: _consolidate(pieces, out, plan, rank, world, fixes))

    def finish() -> None:
        if rank == 0:
            write_hf_index(out, plan, total)
            shutil.rmtree(pieces)
    agreed(env, f"cannot finish the safetensors files in {out}", finish)
    return plan


class _Listing:
    """A file system whose listing shows only the named files (the rest delegated)."""

    def __init__(self, fs: Any, names: set[str]) -> None:
        self._fs, self._names = fs, names

    def ls(self, path: Any) -> list[str]:
        return [entry for entry in self._fs.ls(path) if Path(entry).name in self._names]

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._fs, attribute)


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of the model in ``folder``, as ``from_pretrained`` reads them:
    those the index names, else ``model.safetensors`` (other ``*.safetensors`` files, a
    ``consolidated.safetensors`` beside, are not the model's).

    Raises:
        CheckpointError: an index that is not one, or names a file absent or outside the
            folder; no weights.
    """
    index = folder / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (a 'weight_map' of "
                                  f"tensor names to file names): {exc}") from exc
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or \
                    not (folder / name).is_file():
                raise CheckpointError(f"{index} names the file {name!r}, which is not a "
                                      f"file in {folder}")
        return names
    if (folder / HF_WEIGHTS).is_file():
        return [HF_WEIGHTS]
    raise CheckpointError(f"{folder} holds no {HF_WEIGHTS} nor {HF_INDEX}")


def hf_reader(path: Path) -> Any:
    """DCP's ``HuggingFaceStorageReader`` over the files at ``path`` the index names."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    reader.fs = _Listing(reader.fs, set(weight_files(path)))  # type: ignore[assignment]
    return reader


def stored_tensors(reader: Any, path: Path) -> dict[str, Any]:
    """Each tensor the files at ``path`` hold (read by ``reader``, :func:`hf_reader`): its
    DCP storage metadata (shape, dtype), read from the headers.

    Raises:
        CheckpointError: a tensor in two files or in pieces (a file's DCP sharding offsets,
            untrusted, could leave rows unread: only whole tensors, as ``save_pretrained``
            and ``sw.export`` write them).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {name: meta for name, meta in reader.read_metadata().state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata)}
    twice = sorted(name for name, meta in stored.items()
                   if len(meta.chunks) != 1 or any(meta.chunks[0].offsets)
                   or len(meta.chunks[0].offsets) != len(meta.chunks[0].sizes)
                   or tuple(meta.chunks[0].sizes) != tuple(meta.size))
    if twice:
        raise CheckpointError(f"the safetensors files in {path} hold "
                              f"{', '.join(twice[:5])}{' ...' if len(twice) > 5 else ''} in two "
                              "files or in pieces; whole tensors are read")
    return stored


def _one_by_one(missing: list[str], stored: Mapping[str, Any]) -> str:
    """Why a stacked tensor is missing when the files hold its module's parts numbered one
    by one (``experts.0.gate_proj.weight``: how ``save_pretrained`` writes a mixture of
    experts in Transformers 5, which converts them while loading); '' otherwise."""
    for name in missing:
        module = name.rsplit(".", 1)[0]
        numbered = sorted(key for key in stored if key.startswith(module + ".")
                          and key[len(module) + 1:].split(".", 1)[0].isdigit())
        if numbered:
            return (f". The files hold {module} one part at a time ({numbered[0]}, ...), as "
                    "save_pretrained writes a mixture of experts; the model holds them stacked, "
                    "which Transformers' from_pretrained converts while it reads the whole "
                    "model. Read these files with from_pretrained, or write stacked files once "
                    "with sw.export (one process is enough) and load those")
    return ""


def read_hf_files(env: Env, state: dict[str, Any], path: Path) -> None:
    """Copy Hugging Face safetensors at ``path`` into ``state``'s tensors in place (this
    rank's part: a DTensor's local shard, a stage's tensors), each rank reading only the
    slices it holds (DCP's ``HuggingFaceStorageReader``, over the files the index names);
    every rank calls it, and every rank raises if the files do not fit any rank's part.

    Raises:
        CheckpointError: a tensor missing from the files, of another shape, or in two files,
            named; files that are not the model's weights.
    """
    import torch.distributed.checkpoint as dcp

    readers: list[Any] = []

    def check() -> None:
        readers.append(hf_reader(path))
        stored = stored_tensors(readers[0], path)
        missing = sorted(name for name in state if name not in stored)
        shapes = sorted(f"{name} {tuple(state[name].shape)} (the files: "
                        f"{tuple(stored[name].size)})" for name in state
                        if name in stored and tuple(stored[name].size) !=
                        tuple(state[name].shape))
        if missing or shapes:
            shown = "; ".join([*(f"missing {n}" for n in missing[:5]), *shapes[:5]])
            more = len(missing) > 5 or len(shapes) > 5
            raise CheckpointError(f"the safetensors files in {path} do not fit the model: "
                                  f"{shown}{' ...' if more else ''}{_one_by_one(missing, stored)}")
    agreed(env, "sw.load_pretrained", check)
    dcp.load(state, storage_reader=readers[0])
