# A DCP reader whose metadata is unpickled with an allow-list: loading runs no foreign code.
"""``SafeReader``: torch's ``FileSystemReader`` with a restricted metadata unpickler."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardwise.errors import CheckpointError

__all__ = ["SafeReader"]

_TORCH_NAMES = {"Size", "device", "memory_format", "layout", "contiguous_format",
                "channels_last", "preserve_format", "strided", "sparse_coo"}


class _Unpickler(pickle.Unpickler):
    """Allows DCP's metadata records, torch dtypes/sizes and plain containers, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module.startswith("torch.") else None
        allowed = (
            # DCP's own records: classes only, never its functions
            (module.startswith("torch.distributed.checkpoint.") and isinstance(found, type))
            or (module == "torch" and (name in _TORCH_NAMES
                                       or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in {"PosixPath", "WindowsPath", "PurePosixPath",
                                                 "PureWindowsPath"})
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice", "complex"})
        )
        if not allowed:
            raise CheckpointError(
                f"the checkpoint's metadata refers to {module}.{name}, which a DCP checkpoint "
                "never needs; refusing to load it (it may not be a shardwise checkpoint)")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """Reads a DCP checkpoint, unpickling its metadata with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _Unpickler(stream).load()
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"cannot read checkpoint metadata {path}: {exc}; the "
                                  "checkpoint is partial or corrupt") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
