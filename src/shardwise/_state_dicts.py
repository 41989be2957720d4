# The state dicts a checkpoint holds: model and optimizer tensors for DCP, the rest for JSON.
"""Model and optimizer state in the layouts checkpoints use (FSDP2, DDP, ZeRO-1, one process)."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from shardwise._params import param_names
from shardwise.bundle import Bundle
from shardwise.errors import CheckpointError

__all__ = ["split_optimizer", "materialise", "state_dicts", "plain"]


def split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for DCP, everything else for JSON) of an optimizer state dict."""
    tensors: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for fqn, values in optim_sd.get("state", {}).items():
        tensors[fqn] = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        other[fqn] = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    return {"state": tensors}, {"state": other, "param_groups": optim_sd.get("param_groups", [])}


def materialise(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a step at learning rate 0 on zero gradients)
    so that a checkpoint can be loaded into them; parameters do not change."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optimizer.state for p in params):
        return
    rates = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def _zero_state_dicts(bundle: Bundle) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Under shard_optimizer(): each rank's share of the state, keyed by parameter name as in
    the unsharded layout, so a ZeRO-1 checkpoint loads into any layout and back."""
    engine, optimizer = bundle.sharded_optimizer, bundle.optimizer
    assert engine is not None and optimizer is not None
    local = engine.optim  # type: ignore[attr-defined]
    materialise(local)
    names = param_names(bundle.model)
    tensors: dict[str, Any] = {}
    for param, values in local.state.items():
        extra = [k for k, v in values.items() if not isinstance(v, torch.Tensor)]
        if extra:
            raise CheckpointError(f"shard_optimizer() state holds non-tensor values {extra}; "
                                  "only tensor optimizer state can be checkpointed sharded")
        tensors[names[id(param)]] = dict(values)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return get_model_state_dict(bundle.model), {"state": tensors}, {"state": {},
                                                                    "param_groups": groups}


def state_dicts(bundle: Bundle) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model state, the optimizer's tensors and the optimizer's other values."""
    if bundle.sharded_optimizer is not None:
        return _zero_state_dicts(bundle)
    if bundle.optimizer is None:
        return get_model_state_dict(bundle.model), {}, {}
    model_sd, optim_sd = get_state_dict(bundle.model, bundle.optimizer)
    tensors, other = split_optimizer(optim_sd)
    return model_sd, tensors, other


def plain(value: Any, where: str) -> Any:
    """``value`` as JSON-ready data, or a clear error naming ``where``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot write {where} as JSON ({exc}); shardwise keeps "
                              "non-tensor state in JSON so that loading runs no pickle") from None
