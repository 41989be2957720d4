# The Trainer's checkpoints of a sharded model: whole tensors gathered to save, set into shards to load.
"""Where the Trainer on shardwise saves and loads a model sharded by ``shard()`` (FSDP2).

The Trainer's own checkpoint code writes ``model.state_dict()`` and
``optimizer.state_dict()`` on the main process: for a sharded model, one rank's shards. The
four methods here replace those steps when the model's parameters are DTensors: every rank
takes part in gathering whole tensors (torch's ``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict``), the main process writes them in the
Trainer's own files and layout (``model.safetensors``, ``optimizer.pt``), and loading sets
them back into the shards (``set_model_state_dict`` / ``set_optimizer_state_dict``). A
checkpoint is therefore the same files the Trainer on Accelerate writes for DDP, and loads
into any world size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardwise._params import is_dtensor
from shardwise.errors import CheckpointError

__all__ = ["load_best_model", "load_optimizer_and_scheduler", "save_model_files",
           "save_optimizer_and_scheduler", "sharded"]

#: the Trainer's file names (transformers.trainer's OPTIMIZER_NAME, SCHEDULER_NAME and
#: SAFE_WEIGHTS_NAME), fixed by its checkpoint layout
OPTIMIZER, SCHEDULER, WEIGHTS = "optimizer.pt", "scheduler.pt", "model.safetensors"


def sharded(trainer: Any) -> bool:
    """Whether the Trainer's model holds DTensor shards (prepared by ``shard()``)."""
    return any(is_dtensor(p) for p in trainer.model.parameters())


def save_model_files(trainer: Any, base: Any, output_dir: str | None,
                     state_dict: dict[str, Any] | None) -> None:
    """The Trainer's ``_save`` with the whole state dict gathered first (every rank)."""
    if state_dict is None:
        state_dict = get_model_state_dict(trainer.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    base(trainer, output_dir, state_dict=state_dict)


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
    """The best checkpoint's ``model.safetensors`` set into the shards (every rank reads it).

    Raises:
        CheckpointError: the file is missing, or lacks weights the model has (other than
            weights tied to another).
    """
    from safetensors.torch import load_file

    path = os.path.join(trainer.state.best_model_checkpoint, WEIGHTS)
    if not os.path.isfile(path):
        raise CheckpointError(f"load_best_model_at_end: {path} is missing (the Trainer on "
                              "shardwise saves a sharded model as model.safetensors)")
    state: dict[str, Any] = load_file(path)
    model = trainer.model
    tied = {name for name in getattr(model, "all_tied_weights_keys", {}) or {}}
    missing = set(model.state_dict()) - set(state) - tied  # names only: no collective
    if missing:
        raise CheckpointError(f"load_best_model_at_end: {path} lacks {sorted(missing)[:5]}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                strict=False))
