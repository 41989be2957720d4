# A DCP reader whose metadata is unpickled with an allow-list: loading runs no foreign code.
"""``SafeReader``: torch's ``FileSystemReader`` with a restricted metadata unpickler."""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardwise.errors import CheckpointError

__all__ = ["SafeReader", "SafeLoadPlanner", "storage_files"]

_DCP = "torch.distributed.checkpoint."
# every global a DCP metadata file needs, as exact (module, name) pairs
_ALLOWED = {
    *((_DCP + "metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    (_DCP + "filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                     "PureWindowsPath")),
}


# DCP names its storage files __{rank}_{n}.distcp; any plain name is accepted, nothing else
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


class _Unpickler(pickle.Unpickler):
    """Allows DCP's metadata records, torch dtypes and sizes, paths and sets: nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not ((module, name) in _ALLOWED or dtype):
            raise CheckpointError(
                f"the checkpoint's metadata refers to {module}.{name}, which a DCP checkpoint "
                "never needs; refusing to load it (it may not be a shardwise checkpoint)")
        return super().find_class(module, name)


def _unpickled(path: Path) -> Metadata:
    """DCP's metadata in ``path``, through the allow-list, opened through no symlink."""
    from shardwise.checkpoint.layout import open_regular

    try:
        with open_regular(path, follow=False) as stream:
            metadata = _Unpickler(stream).load()
    except CheckpointError as exc:  # a name off the allow-list
        raise CheckpointError(f"{path}: {exc}") from None
    except Exception as exc:  # a damaged pickle fails in many ways, none of them code
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {type(exc).__name__}:"
                              f" {str(exc)[:120]}; the checkpoint is partial or corrupt"
                              ) from None
    if not (isinstance(metadata, Metadata)
            and isinstance(getattr(metadata, "state_dict_metadata", None), dict)):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata


def _storage_names(path: Path, metadata: Metadata) -> set[str]:
    """The storage files ``metadata`` reads, each checked to be a plain file name in the
    checkpoint directory: no separator, no ``..``, nothing absolute, not hidden."""
    names: set[str] = set()
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path} holds storage data of type {type(storage).__name__}; "
                              "the checkpoint is corrupt")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and _PLAIN_NAME.fullmatch(name)):
            raise CheckpointError(
                f"{path} names the storage file {str(name)[:80]!r}, which is not a plain file "
                "name inside the checkpoint directory; refusing to read it (a forged or "
                "foreign .metadata could make DCP read another checkpoint or wait on a FIFO)")
        names.add(name)
    return names


def storage_files(checkpoint: Path) -> set[str]:
    """The storage files the DCP checkpoint in ``checkpoint`` reads (its ``.metadata``).

    Raises:
        CheckpointError: the metadata is unreadable, off the allow-list, or names a file
            outside the directory.
    """
    path = checkpoint / ".metadata"
    return _storage_names(path, _unpickled(path))


class SafeReader(FileSystemReader):
    """Reads a DCP checkpoint, unpickling its metadata with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata, its storage files checked to be regular files in this directory
        (before DCP opens any of them)."""
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = _unpickled(path)
        for name in sorted(_storage_names(path, metadata)):
            try:
                info = os.lstat(path.parent / name)
            except OSError as exc:
                raise CheckpointError(f"{path.parent / name} cannot be read "
                                      f"({exc.strerror or exc}); the checkpoint is partial") from None
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path.parent / name} is not a regular file (mode "
                                      f"{stat.filemode(info.st_mode)}); refusing to read it")
        storage_meta = getattr(metadata, "storage_meta", None)
        if not isinstance(storage_meta, StorageMeta):
            storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries (a module's extra state) are unpickled with
    ``weights_only=True``: plain containers, numbers, strings and tensors only, no code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"the checkpoint's non-tensor entry {fqn!r} is not plain data ({type(exc).__name__}"
                f": {str(exc)[:120]}); refusing to load it (unpickling it could run code)") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
