# Parameter names across wrappers, and re-binding an optimizer's param groups to new parameters.
"""Keep the user's optimizer object pointing at the model's current parameters."""

from __future__ import annotations

import sys

import torch

from shardwise.errors import OptimizerError

# Name segments that torch.compile and checkpoint_wrapper insert into parameter names.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a ``DistributedDataParallel`` wrapper (or ``model`` itself)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is FSDP2's DTensor (a parameter, gradient or shard of one). Imports
    nothing: a DTensor exists only once ``torch.distributed.tensor`` has been imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def clean_name(name: str) -> str:
    """``name`` without segments wrappers insert: ``_orig_mod.fc.weight`` -> ``fc.weight``."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to its wrapper-free name; a tied parameter keeps its first name."""
    names: dict[int, str] = {}
    for name, param in unwrap(model).named_parameters():
        names.setdefault(id(param), clean_name(name))
    return names


def refuse_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Raise if ``optimizer`` already holds state: it could not follow parameters that move."""
    if optimizer is not None and len(optimizer.state) > 0:
        raise OptimizerError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} "
            "parameter(s); shardwise re-binds the optimizer to the distributed parameters and "
            "cannot carry that state over. Build the pipeline before the first optimizer step, "
            "and restore a checkpoint afterwards")


def rebind_optimizer(optimizer: torch.optim.Optimizer | None, names: dict[int, str],
                     model: torch.nn.Module) -> None:
    """Point each param group of ``optimizer`` at ``model``'s parameters of the same names.

    The optimizer object, its group structure and hyperparameters stay as they are, so an
    LR scheduler bound to it keeps working.

    Args:
        optimizer: the user's optimizer (or ``None``).
        names: :func:`param_names` of the model taken before it was wrapped.
        model: the model now.

    Raises:
        OptimizerError: the optimizer holds state, or a parameter that is not in the model.
    """
    if optimizer is None:
        return
    refuse_state(optimizer)
    current = {clean_name(n): p for n, p in unwrap(model).named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        rebound = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                raise OptimizerError(
                    f"param group {index} of {type(optimizer).__name__} holds a parameter of "
                    f"shape {tuple(param.shape)} that is not in the model; build the optimizer "
                    "from model.parameters()")
            rebound.append(current[name])
        group["params"] = rebound
