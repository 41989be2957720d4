# shard_optimizer(): ZeRO-1 — each rank keeps the optimizer state of its part of the parameters.
"""Optimizer-state sharding with torch's ``ZeroRedundancyOptimizer``."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import attrs

from shardwise._params import refuse_state
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.errors import OptimizerError
from shardwise.transforms.base import Stage, Transform

__all__ = ["ShardOptimizer", "shard_optimizer"]


@attrs.frozen(repr=False)
class ShardOptimizer(Transform):
    """Shard optimizer state across ranks (ZeRO-1) for a :func:`shardwise.replicate` model.

    torch's ``ZeroRedundancyOptimizer`` is built with your optimizer's class, param groups
    and hyperparameters; ``bundle.optimizer`` stays your object (a scheduler bound to it keeps
    working) and the step copies its hyperparameters into the sharded engine each step.

    Example:
        >>> pipe = sw.pipeline(sw.replicate(), sw.shard_optimizer())
    """

    stage: ClassVar[Stage] = Stage.OPTIMIZER
    factory_name: ClassVar[str] = "shard_optimizer"
    keeps_optimizer: ClassVar[str | None] = "distributed"
    distributes: ClassVar[bool] = True

    def excludes(self) -> dict[str, str]:
        return {"shard": "shard() already shards optimizer state; use shard_optimizer() with "
                         "replicate(), or drop it"}

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, optimizer = bundle.env, bundle.optimizer
        if not env.is_distributed:
            return bundle
        if optimizer is None:
            raise OptimizerError(f"{self!r} needs an optimizer: pass one to the pipeline call")
        bundle.engine.with_sharded_optimizer(None)  # refuses an engine that does not replicate
        refuse_state(optimizer)
        # imported here: torch.distributed.optim warns about torch.jit when imported
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups: list[dict[str, Any]] = [dict(g) for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        engine = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
        return attrs.evolve(bundle, engine=bundle.engine.with_sharded_optimizer(engine))

    def describe(self, env: Env) -> str:
        if not env.is_distributed:
            return "one process: nothing to shard"
        return (f"ZeRO-1: ZeroRedundancyOptimizer keeps each of {env.world_size} ranks' share of "
                "the optimizer state, with your optimizer's class, groups and hyperparameters")


#: the public factory: the class itself, so its defaults are written once
shard_optimizer = ShardOptimizer
