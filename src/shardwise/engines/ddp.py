# DDPEngine: the model replicated by DistributedDataParallel, optionally with ZeRO-1 optimizer state.
"""The ``replicate()`` engine."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from shardwise._params import param_names
from shardwise.engines.base import Engine, MemoryParts, set_hyperparameters, state_bytes
from shardwise.engines.step_hooks import Backward, Micro, NoSync, StepRun, WindowEnd
from shardwise.env import Env
from shardwise.errors import CheckpointError, NonFiniteError
from shardwise.state import TrainState

__all__ = ["DDPEngine"]


def _materialise(optimizer: torch.optim.Optimizer) -> None:
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


def _average(tensors: list[torch.Tensor], ranks: int) -> None:
    """Replace each tensor by its mean over ``ranks`` ranks: one all-reduce per dtype and
    device, through a flat buffer."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in groups.values():
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat)
            flat /= ranks
            for tensor, mean in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                tensor.copy_(mean)


def _copy_hyperparameters(source: torch.optim.Optimizer, engine: torch.optim.Optimizer) -> None:
    """Give the sharded optimizer the user's current hyperparameters (a scheduler changes them)."""
    for mine, theirs in zip(source.param_groups, engine.param_groups, strict=True):
        for key, value in mine.items():
            if key != "params":
                theirs[key] = value
    # the user's optimizer is the one an LR scheduler watches: it counts as stepped
    source._opt_called = True  # type: ignore[attr-defined]


@attrs.frozen
class DDPEngine(Engine):
    """``DistributedDataParallel`` over ``world_size`` ranks.

    Attributes:
        world_size: the ranks gradients are averaged over.
        static_graph: DDP's static graph, which must see one synchronised iteration before
            a ``no_sync`` one (the state's ``synced`` says whether it has).
        optimizer_ranks: ranks the optimizer state is split over (ZeRO-1), else 1.
        sharded_optimizer: torch's ``ZeroRedundancyOptimizer`` under ZeRO-1, driven with the
            hyperparameters of the user's optimizer.
        local_sgd_every: local SGD: gradients never all-reduced, parameters averaged every
            this many optimizer steps (None: DDP's gradient averaging).
    """

    world_size: int
    static_graph: bool = False
    optimizer_ranks: int = 1
    sharded_optimizer: torch.optim.Optimizer | None = None
    local_sgd_every: int | None = None
    name: ClassVar[str] = "DistributedDataParallel"

    @property
    def partial_optimizer(self) -> bool:
        return self.optimizer_ranks > 1

    def gradient_ranks(self, env: Env) -> int:
        return 1 if self.local_sgd_every else self.world_size

    def syncs_gradients(self) -> bool:
        return not self.local_sgd_every

    def end_window(self, run: StepRun, state: TrainState, done: Backward, micro: Micro
                   ) -> WindowEnd:
        # every k-th step, and at the end of an epoch (Accelerate's LocalSGD, leaving its context)
        due = bool(self.local_sgd_every) and ((state.step + 1) % (self.local_sgd_every or 1) == 0
                                              or micro.epoch_end)
        try:
            end = super().end_window(run, state, done, micro)
        except NonFiniteError:
            if due:  # each replica checks its own step: one that raises still joins the average
                self.synchronise_replicas(run.model, None)
            raise
        if due:
            run.phase = "averaging the replicas' parameters (local SGD)"
            self.synchronise_replicas(run.model, None)
        return end

    def synchronise_replicas(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                             ) -> None:
        if not self.local_sgd_every:
            return
        tensors = [p.data for p in model.parameters()]
        if optimizer is not None:
            tensors += [v for values in optimizer.state.values() for v in values.values()
                        if isinstance(v, torch.Tensor) and v.is_floating_point()]
        _average(tensors, self.world_size)

    def no_sync(self, model: nn.Module, state: TrainState) -> NoSync | None:
        if self.static_graph and not state.synced:
            return None  # DDP's static graph must see one synchronised iteration first
        no_sync: NoSync = model.no_sync  # type: ignore[assignment]
        return no_sync

    def unwrap(self, model: nn.Module) -> nn.Module:
        module = model.module
        assert isinstance(module, nn.Module)
        return module

    def stepping_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.sharded_optimizer is None:
            return optimizer
        _copy_hyperparameters(optimizer, self.sharded_optimizer)
        return self.sharded_optimizer

    def with_sharded_optimizer(self, sharded: torch.optim.Optimizer | None) -> Engine:
        return attrs.evolve(self, optimizer_ranks=self.world_size, sharded_optimizer=sharded)

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Under ZeRO-1 each rank's share of the optimizer state, keyed by parameter name as
        in the unsharded layout, so a ZeRO-1 checkpoint loads into any layout and back."""
        if self.sharded_optimizer is None or optimizer is None:
            return super().state_dicts(model, optimizer)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        local = self.sharded_optimizer.optim  # type: ignore[attr-defined]
        _materialise(local)
        names = param_names(model)
        tensors: dict[str, Any] = {}
        for param, values in local.state.items():
            extra = [k for k, v in values.items() if not isinstance(v, torch.Tensor)]
            if extra:
                raise CheckpointError(f"shard_optimizer() state holds non-tensor values {extra}; "
                                      "only tensor optimizer state can be checkpointed sharded")
            tensors[names[id(param)]] = dict(values)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        return get_model_state_dict(model), {"state": tensors}, {"state": {},
                                                                "param_groups": groups}

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         loaded: dict[str, Any], other: dict[str, Any]) -> None:
        if self.sharded_optimizer is None or optimizer is None:
            super().load_state_dicts(model, optimizer, loaded, other)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, loaded["model"])
        names = param_names(model)
        saved = loaded["optimizer"].get("state", {})
        with torch.no_grad():
            for param, values in self.sharded_optimizer.optim.state.items():  # type: ignore[attr-defined]
                for key, value in saved.get(names[id(param)], {}).items():
                    values[key].copy_(value)
        set_hyperparameters(optimizer, other["param_groups"])

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        params, grads, opt = state_bytes(model, trained, optimizer_layout, numel=torch.numel,
                                         optimizer_ranks=self.optimizer_ranks)
        layout = f"replicated on {env.world_size} rank(s)"
        if self.optimizer_ranks > 1:
            layout += " + sharded optimizer"
        return MemoryParts(params, grads, opt, 0, layout)

    def describe(self, env: Env) -> str:
        zero = (f"; ZeRO-1: each of {self.optimizer_ranks} ranks keeps its share of the "
                "optimizer state" if self.optimizer_ranks > 1 else "")
        local = (f"; local SGD: gradients stay on each rank, parameters averaged every "
                 f"{self.local_sgd_every} optimizer step(s)" if self.local_sgd_every else "")
        return f"DistributedDataParallel over {self.world_size} ranks ({env.backend}){zero}{local}"
