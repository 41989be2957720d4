# The Trainer's checkpoints of a sharded model: weights written and read by every rank from its shards.
"""Where the Trainer on shardwise saves and loads a model sharded by ``shard()`` (FSDP2) or
split by ``tensor_parallel``.

The Trainer's own checkpoint code writes ``model.state_dict()`` and
``optimizer.state_dict()`` on the main process: for a sharded model, one rank's shards. The
four methods here replace those steps when the model's parameters are DTensors. The weights
go in the Trainer's own file names (``model.safetensors``, or ``model-0000i-of-0000N``
files with ``model.safetensors.index.json`` past 5 GB, as ``save_pretrained`` writes them)
with no gather: every rank writes its shards and the ranks consolidate the files between
them; ``load_best_model_at_end`` reads each rank's slices back. The optimizer state is still
gathered whole into ``optimizer.pt`` (the Trainer's layout) and set back into the shards. A
checkpoint is therefore the same files the Trainer on Accelerate writes for DDP, and loads
into any world size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from shardwise._params import is_dtensor
from shardwise.checkpoint.hf_files import (
    HF_INDEX,
    HF_WEIGHTS,
    MAX_FILE_BYTES,
    export_state,
    holds_weights,
    read_hf_files,
    write_hf_files,
)
from shardwise.errors import CheckpointError

__all__ = ["load_best_model", "load_optimizer_and_scheduler", "save_model_files",
           "save_optimizer_and_scheduler", "sharded", "deferred_weights", "read_deferred"]

#: the Trainer's file names (transformers.trainer's OPTIMIZER_NAME and SCHEDULER_NAME), fixed
#: by its checkpoint layout; its weights' names are save_pretrained's (hf_files.HF_WEIGHTS)
OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"


def sharded(trainer: Any) -> bool:
    """Whether the Trainer's model holds DTensor shards (prepared by ``shard()``)."""
    return any(is_dtensor(p) for p in trainer.model.parameters())


def save_model_files(trainer: Any, base: Any, output_dir: str | None,
                     state_dict: dict[str, Any] | None) -> None:
    """The Trainer's ``_save`` for a sharded model, on every rank: its config, processing
    class and arguments as it writes them (from an empty state dict, as its own DeepSpeed
    path does), the weights in its file names with no gather: every rank writes its shards
    and the ranks consolidate the files (:func:`shardwise.checkpoint.hf_files.write_hf_files`)."""
    import torch.distributed as dist

    if state_dict is not None:  # the caller gathered one itself
        base(trainer, output_dir, state_dict=state_dict)
        return
    folder = Path(output_dir if output_dir is not None else trainer.args.output_dir)
    base(trainer, str(folder), state_dict={})
    if trainer.args.should_save:  # the empty weights, and the files of an earlier save
        for stale in [*folder.glob("model*.safetensors"), folder / HF_INDEX,
                      folder / "pytorch_model.bin"]:
            stale.unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()
    module = trainer.accelerator.unwrap_model(trainer.model)
    write_hf_files(trainer.accelerator.env, export_state(module, None), folder,
                   MAX_FILE_BYTES)


def save_optimizer_and_scheduler(trainer: Any, output_dir: str) -> None:
    """The whole optimizer state in ``optimizer.pt`` (gathered, written by the main process)
    and the scheduler in ``scheduler.pt``, as the Trainer writes them."""
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if trainer.args.should_save:
        torch.save(state, os.path.join(output_dir, OPTIMIZER))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))


def load_optimizer_and_scheduler(trainer: Any, checkpoint: str | None) -> None:
    """``optimizer.pt`` (whole, read by every rank) set into this rank's shards; the
    scheduler as the Trainer loads it."""
    if checkpoint is None:
        return
    path = os.path.join(checkpoint, OPTIMIZER)
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(checkpoint, SCHEDULER))):
        return  # the Trainer, too, starts the optimizer afresh without them
    state = torch.load(path, map_location="cpu", weights_only=True)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER),
                                                    map_location="cpu", weights_only=True))


def load_best_model(trainer: Any) -> None:
    """The best checkpoint's weights read into the shards, each rank only the slices it holds
    (one ``model.safetensors`` or indexed files).

    Raises:
        CheckpointError: no weights there, or weights that do not fit the model (named).
    """
    folder = Path(trainer.state.best_model_checkpoint)
    if not holds_weights(folder):
        raise CheckpointError(f"load_best_model_at_end: {folder} holds no {HF_WEIGHTS} (nor "
                              f"{HF_INDEX}): the Trainer on shardwise saves a sharded model "
                              "in those")
    module = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        read_hf_files(trainer.accelerator.env, export_state(module, None), folder)


def deferred_weights(trainer: Any, checkpoint: str, model: Any) -> bool:
    """Whether resuming from ``checkpoint`` reads the weights after the pipeline has
    distributed the model (each rank its slices, :func:`read_deferred`) instead of the
    Trainer reading them whole into every rank's model first: the Trainer's first call
    (no ``model``), before the model is prepared, on files of the model's own (safetensors,
    no adapter). Records the folder on the accelerator when so."""
    folder = Path(checkpoint)
    accelerator = trainer.accelerator
    if model is not None or getattr(accelerator, "bundle", None) is not None:
        return False
    if any(folder.glob("adapter_model.*")) or any(folder.glob("*/adapter_model.*")):
        return False  # PEFT adapters: the Trainer's own path
    if not holds_weights(folder):
        return False
    accelerator.pending_weights = folder
    return True


def read_deferred(accelerator: Any, module: Any) -> None:
    """The weights a resume left for after the model was distributed, read into this rank's
    shards (every rank calls it, from the accelerator's prepare)."""
    folder = getattr(accelerator, "pending_weights", None)
    if folder is None:
        return
    accelerator.pending_weights = None
    with torch.no_grad():
        read_hf_files(accelerator.env, export_state(module, None), folder)
