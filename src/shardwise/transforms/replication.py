# replicate(): data parallelism with torch's DistributedDataParallel.
"""Replication on DDP."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import attrs
from torch.nn.parallel import DistributedDataParallel

from shardwise._params import is_dtensor, param_names, rebind_optimizer, refuse_state
from shardwise.bundle import Bundle
from shardwise.distributed import ensure_process_group
from shardwise.engines import DDPEngine, Engine, LocalEngine
from shardwise.env import Env
from shardwise.errors import ConflictError
from shardwise.meta_init import is_rank0_weights
from shardwise.plan import Plan
from shardwise.transforms._checks import boolean, positive_number
from shardwise.transforms.base import Distribution

__all__ = ["Replicate", "replicate"]

# torch 2.13 renamed DDP's per-forward buffer sync; older releases only know broadcast_buffers
_BUFFERS_ARG = ("forward_sync_buffers"
                if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                else "broadcast_buffers")


@attrs.frozen(repr=False)
class Replicate(Distribution):
    """Replicate the model on every rank and average gradients with ``DistributedDataParallel``.

    In one process it is a no-op (no wrapper). The module is wrapped in place; the bundle's
    optimizer keeps its object and param groups. Arguments are DDP's (``bucket_mb`` is
    ``bucket_cap_mb``; Transformers' ``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters``,
    ``ddp_broadcast_buffers`` map onto them).

    Raises:
        ValueError: ``bucket_mb`` is not a positive number.

    Example:
        >>> bundle = sw.pipeline(sw.replicate(bucket_mb=50))(model, optimizer, loader)
    """

    bucket_mb: float = attrs.field(default=25, kw_only=True, validator=positive_number)
    find_unused_parameters: bool = attrs.field(default=False, kw_only=True, validator=boolean)
    static_graph: bool = attrs.field(default=False, kw_only=True, validator=boolean)
    gradient_as_bucket_view: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    broadcast_buffers: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    factory_name: ClassVar[str] = "replicate"

    def engine(self, env: Env, plan: Plan) -> Engine:
        """The engine this transform puts in the bundle (settings only, nothing is built)."""
        if not env.is_distributed:
            return LocalEngine()
        # beside fault_tolerant (applied later) the engine is rebuilt without local SGD
        every = plan.local_sgd_every
        if every and self.static_graph:
            raise ConflictError(f"{self!r} and local_sgd(every={plan.local_sgd_every}): DDP's "
                                "static graph must synchronise its first iteration, which local "
                                "SGD never does; drop static_graph=True")
        return DDPEngine(world_size=env.world_size, static_graph=self.static_graph,
                         local_sgd_every=every)

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, model = bundle.env, bundle.model
        if not env.is_distributed:
            return bundle
        if isinstance(model, DistributedDataParallel):
            raise ConflictError(f"{self!r}: the model is already a DistributedDataParallel; "
                                "pass the bare module")
        refuse_state(bundle.optimizer)
        ensure_process_group(env)
        names = param_names(model)
        if is_rank0_weights(model) and not env.is_main:
            model.to_empty(device=env.device)  # DDP broadcasts rank 0's weights and buffers
        model.to(env.device)  # DDP is built on a module that is already on its device
        # expert stacks expert_parallel split (DTensors): their gradients are the dispatch's
        split = [name for name, param in model.named_parameters() if is_dtensor(param)]
        if split:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, split)
        buffers: dict[str, Any] = {_BUFFERS_ARG: self.broadcast_buffers}
        wrapped = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **buffers,
        )
        rebind_optimizer(bundle.optimizer, names, wrapped)
        return attrs.evolve(bundle, model=wrapped, engine=self.engine(env, bundle.plan))

    def describe(self, env: Env) -> str:
        if not env.is_distributed:
            return "one process: no wrapper, nothing to synchronise"
        return (f"DistributedDataParallel over {env.world_size} ranks ({env.backend}), "
                f"{self.bucket_mb} MB buckets; rank 0's weights broadcast at start")


#: the public factory: the class itself, so its defaults are written once
replicate = Replicate
