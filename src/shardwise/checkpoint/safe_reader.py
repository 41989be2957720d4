# A DCP reader whose metadata is unpickled with an allow-list: loading runs no foreign code.
"""``SafeReader``: torch's ``FileSystemReader`` with a restricted metadata unpickler."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardwise.errors import CheckpointError

__all__ = ["SafeReader", "SafeLoadPlanner"]

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


class _Unpickler(pickle.Unpickler):
    """Allows DCP's metadata records, torch dtypes and sizes, paths and sets: nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not ((module, name) in _ALLOWED or dtype):
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
        except CheckpointError as exc:  # a name off the allow-list
            raise CheckpointError(f"{path}: {exc}") from None
        except Exception as exc:  # a damaged pickle fails in many ways, none of them code
            raise CheckpointError(f"cannot read checkpoint metadata {path}: {type(exc).__name__}:"
                                  f" {str(exc)[:120]}; the checkpoint is partial or corrupt"
                                  ) from None
        if not (isinstance(metadata, Metadata)
                and isinstance(getattr(metadata, "state_dict_metadata", None), dict)):
            raise CheckpointError(f"{path} does not hold DCP metadata")
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
