# A replica group's state as its own ranks hold it, sent to a restarted group and put back there.
"""What torchft's checkpoint transport carries from a live replica group to a healing one.

Every rank of a group sends what it holds itself, and the same rank of the healing group
(the same layout: torchft pairs ranks by their place in the group) puts it back in place:
no collective runs, so a group that waits for its peers in a quorum cannot deadlock here
(a state dict gathered with ``get_model_state_dict`` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.engines.base import set_hyperparameters
from shardwise.engines.ddp import _materialise
from shardwise.errors import FaultToleranceError
from shardwise.state import TrainState

__all__ = ["held_state", "put_back", "held_optimizer", "put_back_optimizer", "local"]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's shard, any other tensor itself."""
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, as this rank holds them (no state-dict hooks: FSDP2's
    would gather)."""
    held = {f"p:{name}": local(p.detach()) for name, p in model.named_parameters()}
    held.update({f"b:{name}": local(b) for name, b in model.named_buffers()})
    return held


def held_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state (this rank's parts) and hyperparameters, for :func:`put_back_optimizer`."""
    return {"state": _optimizer_tensors(optimizer),
            "param_groups": [{k: v for k, v in group.items() if k != "params"}
                             for group in optimizer.param_groups]}


def put_back_optimizer(held: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Copy :func:`held_optimizer`'s state into ``optimizer``'s, in place."""
    saved: dict[int, dict[str, Any]] = held["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if saved and not all(p in optimizer.state for p in params if p.requires_grad):
        _materialise(optimizer)  # the state tensors to copy into (a step at rate 0)
    for index, param in enumerate(params):
        for key, value in saved.get(index, {}).items():
            current = optimizer.state[param].get(key)
            if isinstance(current, torch.Tensor):
                _copy(local(current), value, f"optimizer state {key!r} of parameter {index}")
            elif isinstance(value, torch.Tensor) and key != "step":  # on the parameter's device
                optimizer.state[param][key] = value.to(local(param).device)
            else:
                optimizer.state[param][key] = value
    set_hyperparameters(optimizer, held["param_groups"])


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's state by the parameter's place in its param groups, each tensor this
    rank's part."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index: {key: local(value) if isinstance(value, torch.Tensor) else value
                    for key, value in optimizer.state[param].items()}
            for index, param in enumerate(params) if param in optimizer.state}


def held_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
               scaler: Any, state: TrainState) -> dict[str, Any]:
    """What this rank holds: weights and buffers, the optimizer's state and hyperparameters,
    the scheduler's and grad scaler's state, and the training progress (data position
    included). The tensors are the live ones (torchft's transport stops serving them before
    the next optimizer step)."""
    held: dict[str, Any] = {"model": _tensors(model), "train_state": state.to_dict()}
    if optimizer is not None:
        held["optimizer"] = held_optimizer(optimizer)
    if scheduler is not None:
        held["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        held["scaler"] = scaler.state_dict()
    return held


def _copy(into: torch.Tensor, value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != into.shape:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise FaultToleranceError(
            f"healing from a peer replica group: {what} is {shape} there and "
            f"{tuple(into.shape)} here; every replica group must run the same model on the same "
            "layout (the same ranks per group and the same transforms)")
    with torch.no_grad():
        into.copy_(value)


def put_back(held: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
             scheduler: Any, scaler: Any) -> TrainState:
    """Copy a peer rank's :func:`held_state` into this rank's objects, in place; return its
    training progress.

    Raises:
        FaultToleranceError: the peer's names or shapes are not this rank's.
    """
    mine = _tensors(model)
    theirs = held.get("model", {})
    if set(mine) != set(theirs):
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        raise FaultToleranceError(
            f"healing from a peer replica group: its model differs (missing there: "
            f"{[n[2:] for n in missing[:5]]}, only there: {[n[2:] for n in extra[:5]]}); every "
            "replica group must run the same model")
    for name, tensor in mine.items():
        _copy(tensor, theirs[name], name[2:])
    if optimizer is not None and "optimizer" in held:
        put_back_optimizer(held["optimizer"], optimizer)
    if scheduler is not None and "scheduler" in held:
        scheduler.load_state_dict(held["scheduler"])
    if scaler is not None and "scaler" in held:
        scaler.load_state_dict(held["scaler"])
    return TrainState.from_dict(held["train_state"])
