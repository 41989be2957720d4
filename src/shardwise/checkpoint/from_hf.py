# Hugging Face safetensors as a weights-only sw.save checkpoint, offline, one tensor in memory at a time.
"""Convert a folder ``save_pretrained`` (or ``sw.export``) wrote into a checkpoint in
``sw.save``'s format (DCP), in one process on any machine: DCP plans the checkpoint from
the files' headers and reads each tensor from its file only when it writes it, into a
storage file of its own (DCP's writer holds a file's tensors until the file ends), so one
tensor is in memory at a time (0.04x of a 38 MB model, measured). Any number of ranks,
under any layout, then loads it with ``sw.load(..., skip=WEIGHTS_ONLY_SKIP)``, each rank
reading only its shards.

The checkpoint holds the model's weights only (no optimizer state, scheduler, scaler or
generator states; train state at step 0) and says so in its record (``weights_only``), so
a load that would silently start those parts fresh is refused by name instead.

A tied weight is stored once in the files (``save_pretrained`` drops ``lm_head.weight``
when it is the embedding) and under every name the model gives it in the checkpoint, as
``sw.save`` writes it: the ties are read from the model ``config.json`` describes, built
on the meta device (no memory).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import CheckpointError

__all__ = ["hf_to_checkpoint", "tied_names", "WEIGHTS_ONLY_SKIP"]

#: what ``sw.load`` skips for a weights-only checkpoint: everything but the model
WEIGHTS_ONLY_SKIP = ("optimizer", "scheduler", "scaler", "rng")
PREFIX = "model."


def tied_names(folder: Path) -> list[list[str]]:
    """The groups of names one tied parameter has in the Transformers model that
    ``folder/config.json`` describes (built on the meta device), the name
    ``named_parameters`` gives first (the one ``save_pretrained`` keeps) first; [] without
    a ``config.json``.

    Raises:
        CheckpointError: a ``config.json`` Transformers cannot build a model from.
    """
    if not (folder / "config.json").is_file():
        return []
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(str(folder))
        architectures = getattr(config, "architectures", None) or []
        cls = getattr(transformers, str(architectures[0]), None) if architectures else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            cls = None  # only a model class of Transformers' is built from the name
        with torch.device("meta"):
            model = cls(config) if cls is not None else \
                transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # a config of another library or version: many error types
        raise CheckpointError(f"{folder / 'config.json'}: Transformers builds no model from it "
                              f"({type(exc).__name__}: {exc}), so its tied weights are "
                              "unknown") from None
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _aliases(stored: dict[str, Any], ties: list[list[str]]) -> dict[str, str]:
    """Each name of a tied group the files lack -> the group's name they hold."""
    out = {}
    for names in ties:
        held = [n for n in names if n in stored]
        if held:
            out.update({n: held[0] for n in names if n not in stored})
    return out


def hf_to_checkpoint(model: str | os.PathLike[str], directory: str | os.PathLike[str], *,
                     name: str | None = None) -> Path:
    """Write the Hugging Face safetensors in the folder ``model`` (the files its index
    names, or ``model.safetensors``) as a weights-only checkpoint of ``sw.save``'s format:
    ``directory/step_00000000`` (``latest`` names it), or ``directory/<name>``. Published
    as a transaction (sealed with checksums, renamed in whole).

    Raises:
        CheckpointError: no weights, a forged index, a tensor in two files, a
            ``config.json`` Transformers cannot read, or the directory cannot be written.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from shardwise.checkpoint import integrity
    from shardwise.checkpoint.background import cause
    from shardwise.checkpoint.hf_files import hf_reader, stored_tensors
    from shardwise.checkpoint.layout import (
        FORMAT,
        META,
        TORCH_FORMAT,
        check_name,
        latest_checkpoint,
        write_durably,
    )
    from shardwise.checkpoint.restore import dcp_quietly
    from shardwise.checkpoint.transaction import TMP, begin, seal_and_publish
    from shardwise.env import Env
    from shardwise.state import TrainState

    source, root = Path(model), Path(directory)
    if name is not None:
        try:
            check_name(name, "from-hf --name")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    elif latest_checkpoint(root) is not None or (root / f"step_{0:08d}").exists():
        raise CheckpointError(f"{root} holds checkpoints already (newest: "
                              f"{latest_checkpoint(root) or f'step_{0:08d}'}); a weights-only "
                              "step_00000000 would become what latest names, or replace a "
                              "step 0 of that run: write into an empty directory, or pass "
                              "--name for a named checkpoint beside them")
    file_of: dict[str, str] = {}  # each tensor's file, from the headers (an index is not trusted)
    try:
        reader = hf_reader(source)
        stored = stored_tensors(reader, source)
        for file in sorted(Path(p).name for p in reader.fs.ls(str(source))):
            with safe_open(str(source / file), framework="pt") as opened:
                file_of.update({key: file for key in opened.keys()})
    except CheckpointError:
        raise
    except Exception as exc:  # a header that does not parse: safetensors' and DCP's errors
        raise CheckpointError(f"the safetensors files in {source} cannot be read "
                              f"({type(exc).__name__}: {exc})") from None
    if not stored:
        raise CheckpointError(f"the safetensors files in {source} hold no tensors")
    aliases = _aliases(stored, tied_names(source))
    meta_state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype,
                                   device="meta") for key, meta in stored.items()}
    meta_state.update({alias: meta_state[held] for alias, held in aliases.items()})

    class _FromFiles(DefaultSavePlanner):
        """Each tensor read from its file when DCP writes it (one in memory at a time)."""

        def resolve_data(self, write_item: WriteItem) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            key = write_item.index.fqn.removeprefix(PREFIX)
            key = aliases.get(key, key)
            with safe_open(str(source / file_of[key]), framework="pt") as opened:
                tensor = opened.get_tensor(key)
            planned = meta_state[key]
            if tuple(tensor.shape) != tuple(planned.shape) or tensor.dtype != planned.dtype:
                raise CheckpointError(f"{source / file_of[key]}: {key} is {tuple(tensor.shape)} "
                                      f"{tensor.dtype}, its header said {tuple(planned.shape)} "
                                      f"{planned.dtype} (the file changed, or is forged)")
            return tensor

    env = Env()
    final = root / (name if name is not None else f"step_{0:08d}")
    tmp = root / f"{TMP}{final.name}"
    root.mkdir(parents=True, exist_ok=True)
    lock = begin(env, root, tmp)
    published = False
    try:
        # a file per tensor: DCP's writer keeps every tensor of a file until the file ends
        with dcp_quietly():
            dcp.save({"model": meta_state, "optimizer": {}}, planner=_FromFiles(),
                     storage_writer=FileSystemWriter(tmp, single_file_per_rank=False),
                     no_dist=True)
        record = {"format": FORMAT, "name": final.name, "checksums": integrity.MANIFEST,
                  "engine": TORCH_FORMAT, "train_state": TrainState().to_dict(),
                  "world_size": 1, "weights_only": str(source),
                  "parts": {"optimizer": None, "scheduler": None, "scaler": False},
                  "data": {"epoch": 0, "batch_in_epoch": 0, "seed": None, "cursor": None},
                  "optimizer": {}, "scheduler": None, "scaler": None}
        write_durably(tmp / META, json.dumps(record, indent=1))
        written = integrity.digests_of(tmp, 0)
        # no generator states: ranks=0, so the manifest needs no rng files
        seal_and_publish(root, tmp, final, 0, None, 0, written)
        published = True
    except (Exception, CheckpointException) as exc:  # DCP wraps what its writer raised
        raise CheckpointError(f"writing {final} failed ({cause(exc, tmp)}); nothing was "
                              "published") from None
    finally:
        if not published:
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            lock.release()
    return final
