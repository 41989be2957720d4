# tensor_parallel(): layers split across a group of ranks with torch's parallelize_module (DTensor).
"""Tensor parallelism on the ``tp`` dimension of the pipeline's mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from shardwise._params import is_dtensor, param_names, rebind_optimizer, refuse_state
from shardwise.bundle import Bundle
from shardwise.distributed import all_agree, ensure_process_group
from shardwise.engines import Engine, LocalEngine, TPEngine
from shardwise.env import Env
from shardwise.errors import ConflictError
from shardwise.meta_init import is_rank0_weights
from shardwise.parallel.mesh import stage_peers, with_dimension
from shardwise.parallel.moe_dispatch import is_expert_stack
from shardwise.parallel.pp_stages import cut_from
from shardwise.parallel.tp_plan import (
    check_plan_value,
    local_shapes,
    model_plan,
    resolve,
    split_dims,
    torch_style,
    whole_owners,
)
from shardwise.plan import Plan
from shardwise.transforms._checks import group_size
from shardwise.transforms.base import Stage, Transform, plan_for

__all__ = ["TensorParallel", "tensor_parallel"]


def _plan(instance: Any, attribute: Any, value: Any) -> None:
    check_plan_value(value)


def _from_first(model: nn.Module, peers: Any) -> None:
    """Every rank starts from the weights and buffers of the first rank of ``peers`` (rank 0,
    or under pipeline parallelism the first rank holding the same stages), as under DDP:
    split layers take their part of them, the rest is whole and the same everywhere."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not is_expert_stack(tensor):  # rank 0's experts, split already
                dist.broadcast(tensor.data, group=peers, group_src=0)


def _as_replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not is_dtensor(x) else x for x in inputs)


def _as_local(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to_local() if is_dtensor(x) else x, outputs)


def keep_whole(module: nn.Module, tp_mesh: Any) -> None:
    """Make a leaf module's parameters replicated DTensors on the tensor-parallel mesh: it
    computes on whole tensors as before (inputs taken as replicated, outputs handed back
    as plain tensors), while every parameter of the model is a DTensor of one mesh."""
    from torch.distributed.tensor import distribute_module

    hooks: dict[str, Any] = {"input_fn": _as_replicated, "output_fn": _as_local}
    distribute_module(module, tp_mesh, **hooks)


@attrs.frozen(repr=False)
class TensorParallel(Transform):
    """Split layers across the ranks of a tensor-parallel group with torch's
    ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel`` DTensors).

    Each rank holds its part of the split layers' weights and computes its part of their
    outputs; the other parameters stay whole on every rank, and all ranks of a group read
    the same batch. With more ranks than ``size`` the rest are data parallel: ``shard()``
    then shards over the data dimension of the mesh only (``dp_shard x tp``, or
    ``dp_replicate x dp_shard x tp`` with ``replicate_across_nodes``). Applied before
    activation checkpointing and distribution; the module changes in place and the
    optimizer is re-bound to the split parameters. Every rank starts from rank 0's weights
    (under ``pipeline_parallel``, applied first, the first rank's holding the same stages:
    each stage's layers are split over its own tensor-parallel group).
    In one process (or ``size=1``) it is a no-op.

    Args:
        plan: ``"auto"``: the model's own plan (a Transformers model's ``_tp_plan`` /
            ``config.base_model_tp_plan``); or a dict of module-name patterns (``*`` for one
            name part) to styles: ``"colwise"``, ``"rowwise"``, ``"colwise_rep"`` (output
            gathered), ``"rowwise_rep"`` (input whole), ``"embedding_rowwise"``,
            ``"replicated_with_grad_allreduce"`` (weights whole, gradient summed), ... or
            torch ``ParallelStyle`` objects.
        size: ranks per tensor-parallel group; default all ranks of one node.

    Raises:
        ConflictError: no plan, a pattern that matches no module, a size that a split
            dimension or the attention heads do not divide by, tied weights split apart.

    Example:
        >>> pipe = sw.pipeline(sw.tensor_parallel(size=2), sw.shard())  # dp_shard x tp
    """

    splits_weights = True

    plan: str | Mapping[str, Any] = attrs.field(default="auto", validator=_plan)
    size: int | None = attrs.field(default=None, kw_only=True, validator=group_size("the ranks of one node"))
    stage: ClassVar[Stage] = Stage.TENSOR_PARALLEL
    factory_name: ClassVar[str] = "tensor_parallel"
    distributes: ClassVar[bool] = True

    def mesh_dims(self) -> dict[str, int | None]:
        return {"tp": self.size}

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, tensor_parallel=self)

    def excludes(self) -> dict[str, str]:
        why = ("splits layers into DTensors, which {} cannot run; use shard() for the data "
               "ranks (FSDP2 on the mesh's dp_shard dimension)")
        return {"replicate": why.format("DDP"), "shard_optimizer": why.format("ZeRO-1"),
                "deepspeed": why.format("DeepSpeed")}

    def resolved(self, model: nn.Module, size: int) -> dict[str, Any]:
        """Each module this plan splits (full name -> style), checked for ``size``."""
        if self.plan == "auto":
            return resolve(model, model_plan(model), size, own=True)
        return resolve(model, dict(self.plan), size)  # type: ignore[arg-type]

    def local_shapes(self, model: nn.Module, size: int) -> dict[int, tuple[int, ...]]:
        """``id(parameter)`` -> the shape one rank holds, for each parameter split (of the
        whole model a pipeline stage's modules were taken from, for those)."""
        model = cut_from(model)
        return local_shapes(model, self.resolved(model, size), size)

    def whole_gradients(self, model: nn.Module, size: int) -> set[int]:
        """Ids of split parameters whose gradient DTensor leaves whole on every rank until
        the optimizer step: a rowwise-split embedding's (its backward gives Replicate)."""
        model = cut_from(model)
        modules = dict(model.named_modules())
        return {id(modules[name].weight) for name, style in self.resolved(model, size).items()
                if isinstance(modules[name], nn.Embedding)
                and split_dims(modules[name], style).get("weight") == 0}

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, model = bundle.env, bundle.model
        size = bundle.plan.size("tp")  # the pipeline's layout: this size is read, never worked out
        if not env.is_distributed or size == 1:
            return bundle
        if any(is_dtensor(p) and not is_expert_stack(p) for p in model.parameters()) or \
                isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConflictError(f"{self!r}: the model is split or wrapped already "
                                f"({type(model).__name__}); pass the bare module")
        if is_rank0_weights(model):
            raise ConflictError(f"{self!r}: a model built by sw.init_on_meta holds its weights on "
                                "rank 0 only, which tensor_parallel does not split yet; build it "
                                "normally (every rank starts from rank 0's weights anyway)")
        refuse_state(bundle.optimizer)
        ensure_process_group(env)
        chosen = self._resolved_everywhere(model, size, bundle.plan.pipeline_parallel is not None,
                                           env)
        mesh = with_dimension(bundle.mesh, env, bundle.plan.mesh, "tp", size, repr(self))
        names = param_names(model)
        if not all(p.is_meta for p in model.parameters()):  # a meta model: shapes only
            model.to(env.device)
            _from_first(model, stage_peers(mesh))
        modules = dict(model.named_modules())
        # imported when first used: DTensor takes most of a second to import
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"],
                           {name: torch_style(modules[name], style) for name, style in chosen.items()})
        for name in whole_owners(model, chosen):
            keep_whole(modules[name], mesh["tp"])
        rebind_optimizer(bundle.optimizer, names, model)
        return attrs.evolve(bundle, mesh=mesh, engine=self.engine(env, bundle.plan))

    def _resolved_everywhere(self, model: nn.Module, size: int, staged: bool, env: Env
                             ) -> dict[str, Any]:
        """:meth:`resolved`, refused on every rank when it is refused on one. Under pipeline
        parallelism each rank checks the plan against the modules its stages hold, so a
        module only the last stage holds (a head the size does not divide) is checked there
        only; the other ranks must not go on into collectives that would wait for it.

        Raises:
            ConflictError: this rank's refusal, or another stage's (named as such).
        """
        if not staged:
            return self.resolved(model, size)
        refusal: ConflictError | None = None
        chosen: dict[str, Any] = {}
        try:
            chosen = self.resolved(model, size)
        except ConflictError as exc:
            refusal = exc
        if not all_agree(env, refusal is None):
            raise refusal or ConflictError(f"{self!r}: the plan was refused on the ranks of "
                                           "another pipeline stage (their error names the "
                                           "module); fix the plan or the size")
        return chosen

    def engine(self, env: Env, plan: Plan) -> Engine:
        """The engine this transform puts in the bundle when no distribution follows it
        (settings only, nothing is built), its size the ``plan``'s layout's."""
        if not env.is_distributed or plan.mesh is None or plan.mesh.tp == 1:
            return LocalEngine()
        return TPEngine(mesh=plan.mesh, tensor_parallel=self)

    def describe(self, env: Env) -> str:
        return self.describe_in(env, plan_for(env, [self]))

    def describe_in(self, env: Env, plan: Plan) -> str:
        size = plan.size("tp")
        if not env.is_distributed or size == 1:
            return "one rank per group: nothing to split"
        source = "the model's own plan" if self.plan == "auto" else \
            f"{len(self.plan)} plan entries"
        return (f"parallelize_module on the mesh's tp dimension ({size} ranks): layers split "
                f"by {source} (DTensor Colwise/RowwiseParallel), the rest whole on every "
                f"rank; the {size} ranks of a group read the same batch")


#: the public factory: the class itself, so its defaults are written once
tensor_parallel = TensorParallel
