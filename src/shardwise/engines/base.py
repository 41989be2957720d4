# Engine: the interface every distribution engine implements, with one process's behaviour as default.
"""The engine interface and what its implementations share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from shardwise.engines.step_hooks import StepHooks
from shardwise.env import Env
from shardwise.errors import CheckpointError, ConflictError
from shardwise.state import TrainState

__all__ = ["Engine", "MemoryParts", "state_bytes", "split_optimizer",
           "set_hyperparameters"]

@attrs.frozen
class MemoryParts:
    """Device bytes of one rank's training state under an engine, and what was estimated."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    working_bytes: int
    layout: str


def state_bytes(model: nn.Module, trained: set[int], optimizer_layout: tuple[float, float], *,
                numel: Callable[[torch.Tensor], int], full_grads: bool = False,
                optimizer_ranks: int = 1,
                full_numel: Callable[[torch.Tensor], int] = torch.numel) -> tuple[int, int, int]:
    """Bytes of parameters (and buffers), fp32 gradients and optimizer state on one rank.

    Args:
        model: the (unwrapped) model.
        trained: ids of the parameters the optimizer trains.
        optimizer_layout: (bytes per parameter element, bytes per parameter tensor).
        numel: elements of a parameter held by this rank.
        full_grads: gradients are held whole (accumulating without reduction), not sharded.
        optimizer_ranks: ranks the optimizer state is split over (ZeRO-1).
        full_numel: elements of a parameter before data-parallel sharding (its
            tensor-parallel part, when split across a group).
    """
    params = list(model.parameters())
    held = {id(p): numel(p) for p in params}
    param_bytes = sum(held[id(p)] * p.element_size() for p in params)
    param_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    grads = sum(full_numel(p) if full_grads else held[id(p)] for p in params if id(p) in trained)
    per_element, per_tensor = optimizer_layout
    opt = int(sum(per_element * held[id(p)] + per_tensor for p in params if id(p) in trained))
    if optimizer_ranks > 1:
        opt = -(-opt // optimizer_ranks)
    return param_bytes, grads * 4, opt


def split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for DCP, everything else for JSON) of an optimizer state dict."""
    tensors: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for fqn, values in optim_sd.get("state", {}).items():
        tensors[fqn] = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        other[fqn] = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    return {"state": tensors}, {"state": other, "param_groups": optim_sd.get("param_groups", [])}


#: param-group keys that choose how an optimizer computes, not what: the running optimizer
#: keeps its own (a checkpoint written by another implementation must not switch it)
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _typed_groups(optimizer: torch.optim.Optimizer,
                  groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved groups as this optimizer takes them: JSON's lists turned back into tuples
    where the optimizer keeps tuples (e.g. betas), its own implementation keys kept."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} optimizer param groups, the "
                              f"optimizer {len(optimizer.param_groups)}")
    return [{k: mine[k] if k in IMPLEMENTATION and k in mine else
             tuple(v) if isinstance(mine.get(k), tuple) and isinstance(v, list) else v
             for k, v in saved.items()} for mine, saved in zip(optimizer.param_groups, groups,
                                                                strict=True)]


def set_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Give ``optimizer``'s param groups the saved hyperparameters (not the parameters)."""
    for mine, saved in zip(optimizer.param_groups, _typed_groups(optimizer, groups), strict=True):
        mine.update({k: v for k, v in saved.items() if k != "params"})


class Engine(StepHooks):
    """How one distribution engine runs the parts of training that differ between engines.

    The defaults are one process's behaviour: no wrapper, gradients complete on this rank,
    torch's own state dicts. The step's two hooks, and the questions the native ones ask,
    come from :class:`~shardwise.engines.step_hooks.StepHooks`. An engine is a frozen
    record; ``name`` names it in ``explain()``.
    """

    name: ClassVar[str] = "one process"
    #: precision carried out by casting parameters (FSDP2), so the forward runs no autocast
    casts_parameters: ClassVar[bool] = False
    #: the wrapper put each parameter (shard) on its device already (FSDP2)
    places_parameters: ClassVar[bool] = False
    #: the engine placed the model and holds the optimizer's parameters itself (DeepSpeed's
    #: flat partitions): placement leaves both alone
    owns_optimizer: ClassVar[bool] = False
    #: the model's state dict is what each rank holds as torch tensors or DTensors, so
    #: ``sw.export`` writes it from every rank without a gather (DeepSpeed's partitions: no)
    exports_in_place: ClassVar[bool] = True

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the engine's wrapper."""
        return model

    def full_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The user's module's state dict, each tensor whole (gathered from every rank when
        sharded: every rank iterates it), for export."""
        for name, value in self.unwrap(model).state_dict().items():
            yield name, self.full(value)

    def synchronise_replicas(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                             ) -> None:
        """Make every rank's replica the same where the engine lets them drift apart (local
        SGD): parameters, and the optimizer's state when given, averaged over the ranks. A
        collective where it does anything; nothing to do by default."""

    def begin(self, bundle: Any, state: TrainState) -> TrainState:
        """The state training starts from, given ``state`` (a fresh one, or a checkpoint's):
        ``state`` itself, except where replicas elsewhere may be ahead (fault tolerance)."""
        return state

    @property
    def sharded_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that holds sharded optimizer state (ZeRO-1), if any."""
        return None

    def with_sharded_optimizer(self, sharded: torch.optim.Optimizer | None) -> Engine:
        """This engine with optimizer state sharded by ``sharded`` (ZeRO-1).

        Raises:
            ConflictError: the engine does not replicate the model.
        """
        raise ConflictError(
            f"shard_optimizer() shards the optimizer of a replicated model; the model is run "
            f"by {self.name}. Use it with sw.replicate() (shard() already shards optimizer "
            "state)")

    # -- checkpoints ------------------------------------------------------------------------

    #: the folder name of the engine's own checkpoint format (DeepSpeed's), written by
    #: :meth:`save_own` instead of DCP's files; None: DCP through :meth:`state_dicts`
    own_checkpoint: ClassVar[str | None] = None

    def save_own(self, path: Path) -> None:
        """Write the model and optimizer in the engine's own format under ``path`` (every
        rank calls it; all ranks' files are written when it returns)."""
        raise NotImplementedError

    def check_own(self, path: Path) -> None:
        """Check what :meth:`save_own` wrote under ``path`` before any of it is read (no
        collective: every rank checks the same files).

        Raises:
            CheckpointError: a file that could run code when read.
        """
        raise NotImplementedError

    def load_own(self, path: Path) -> None:
        """Read what :meth:`save_own` wrote under ``path`` into the model and optimizer.

        Raises:
            CheckpointError: a file that could run code when read, or that does not fit.
        """
        raise NotImplementedError

    @property
    def partial_optimizer(self) -> bool:
        """Whether each rank loads only part of a checkpoint's optimizer keys (ZeRO-1)."""
        return False

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The model state, the optimizer's tensors and its other values, in the layout DCP
        saves and loads (unsharded names; sharded tensors as DTensors)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return get_model_state_dict(model), {}, {}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tensors, other = split_optimizer(optim_sd)
        return model_sd, tensors, other

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         loaded: dict[str, Any], other: dict[str, Any]) -> None:
        """Put ``loaded`` (DCP's model and optimizer tensors, read in place into
        :meth:`state_dicts`' layout) and ``other`` (the JSON part) into model and optimizer."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if optimizer is None:
            set_model_state_dict(model, loaded["model"])
            return
        state = {fqn: {**values, **other.get("state", {}).get(fqn, {})}
                 for fqn, values in loaded["optimizer"].get("state", {}).items()}
        optim_sd: dict[str, Any] = {"state": state,
                                    "param_groups": _typed_groups(optimizer,
                                                                  other["param_groups"])}
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=optim_sd)

    # -- memory -----------------------------------------------------------------------------

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        """One rank's bytes for ``model`` under this engine (nothing is allocated)."""
        params, grads, opt = state_bytes(model, trained, optimizer_layout, numel=torch.numel)
        return MemoryParts(params, grads, opt, 0, f"replicated on {env.world_size} rank(s)")

    def describe(self, env: Env) -> str:
        """One line on what the engine does under ``env``."""
        return "one process: no wrapper, nothing to synchronise"
