# expert_parallel(): each rank holds 1/ep of every expert stack; tokens go to their experts by all-to-all.
"""Expert parallelism for mixture-of-experts models."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import attrs
from torch import nn

from shardwise._params import param_names, rebind_optimizer, refuse_state
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.distributed import all_agree, ensure_process_group
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConflictError
from shardwise.meta_init import is_rank0_weights, weights_pending
from shardwise.parallel.mesh import MeshLayout, data_share, stage_peers
from shardwise.parallel.moe_dispatch import (
    expert_count,
    expert_stacks,
    is_expert_stack,
    split_experts,
)
from shardwise.plan import Plan
from shardwise.transforms._checks import group_size
from shardwise.transforms.base import Stage, Transform, plan_for

__all__ = ["ExpertParallel", "expert_parallel", "experts_modules"]

#: the arguments of an experts module's forward (Transformers 5's experts interface; GPT-OSS
#: names them its own way)
_ARGUMENTS = (("hidden_states", "top_k_index", "top_k_weights"),
              ("hidden_states", "router_indices", "routing_weights"))


def _experts(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, (str, type)):
        raise ArgumentError(f"expert_parallel() 'experts' must be None (found from the model), "
                            f"a module class or its name (got {short(value)})")


def _takes_routing(module: nn.Module) -> bool:
    try:
        names = tuple(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names in _ARGUMENTS


def experts_modules(model: nn.Module, declared: str | type | None = None) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model``: of the ``declared`` class (or class name), else
    every module with an integer ``num_experts`` whose forward takes ``(hidden_states,
    top_k_index, top_k_weights)`` (Transformers 5's experts: Qwen3-MoE, Mixtral,
    DeepSeek-V3, ...) or ``(hidden_states, router_indices, routing_weights)`` (GPT-OSS)."""
    found = []
    for name, module in model.named_modules():
        if declared is not None:
            kind = type(module)
            if kind is declared or kind.__name__ == declared:
                found.append((name, module))
        elif isinstance(getattr(module, "num_experts", None), int) and _takes_routing(module):
            found.append((name, module))
    return found


@attrs.frozen(repr=False)
class ExpertParallel(Transform):
    """Split every experts module of a mixture of experts over the ranks: each holds
    ``E / size`` of the experts of every layer, and tokens travel to their experts' ranks
    and back by all-to-all.

    The ranks read different batches, as data-parallel ranks do; the other weights are
    replicated (``replicate()``, the default beside it) or sharded by FSDP2 (``shard()``,
    which leaves the expert stacks to the dispatch, or with replica groups shards each
    experts module across the replicas). Each (token, choice) pair the
    model's router picks is sent to the rank holding that expert (``all_to_all_single``,
    uneven counts, autograd through it); the module's own forward runs there on the
    received rows against the local experts; the results return by the reverse all-to-all
    and are weighed and summed per token as the module does. The expert stacks are DTensors
    sharded on the expert dimension, so checkpoints, exports and ``full_state`` keep the
    model's names and whole shapes. Parameters equal one process's on the global batch.

    A Transformers 5 MoE model (its ``*Experts`` modules) is found as it is; a model of
    one's own declares its experts class: its ``forward(hidden_states, top_k_index,
    top_k_weights)`` on ``[tokens, hidden]`` rows with ``num_experts`` and weights stacked
    with the expert first. In one process (or ``size=1``) it is a no-op.

    Args:
        size: data ranks the experts are split over (an expert group); default every data
            rank (every rank when nothing else splits the model). A smaller size that divides
            them makes ``data / size`` groups, replicas of each other (data ranks ``g*size``
            to ``g*size + size - 1`` form group ``g``), whose expert gradients are summed
            across them.
        experts: the experts module class (or its name) of a model of one's own.

    Raises:
        ConflictError: no experts module, an expert count the size does not divide, a size
            that does not divide the data ranks.

    Example:
        >>> pipe = sw.pipeline(sw.expert_parallel())  # Qwen3-MoE on 2 ranks: 4 experts each
    """

    size: int | None = attrs.field(default=None, validator=group_size("every data rank"))
    experts: str | type | None = attrs.field(default=None, kw_only=True, validator=_experts)
    stage: ClassVar[Stage] = Stage.EXPERT_PARALLEL
    factory_name: ClassVar[str] = "expert_parallel"
    distributes: ClassVar[bool] = True
    #: the expert stacks are DTensors beside plain tensors: one foreach or fused kernel
    #: call cannot take both, so each tensor is updated on its own (the same arithmetic)
    keeps_optimizer: ClassVar[str | None] = "distributed"

    def excludes(self) -> dict[str, str]:
        why = "is not combined with expert_parallel yet (the experts' own mesh beside " \
              "it is not built); replicate() or shard() the other weights"
        return {name: f"{name}() {why}" for name in
                ("context_parallel", "local_sgd", "shard_optimizer", "deepspeed")}

    def ep_size(self, env: Env, layout: MeshLayout | None = None) -> int:
        """Ranks the experts are split over under ``env`` and the pipeline's mesh ``layout``
        (default: every data rank, the ranks that read different batches)."""
        return self.size if self.size is not None else _data_ranks(env, layout)

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, model, layout = bundle.env, bundle.model, bundle.plan.mesh
        size, data = self.ep_size(env, layout), _data_ranks(env, layout)
        if not env.is_distributed or size == 1:
            return bundle
        if data % size:
            raise ConflictError(f"{self!r}: {size} ranks per expert group do not divide the "
                                f"{data} data ranks into replicas of the group; pick a "
                                f"divisor of {data}")
        if is_rank0_weights(model) or weights_pending(model) is not None:
            raise ConflictError(f"{self!r}: a model built by sw.init_on_meta is not split into "
                                "experts yet (its weights are on rank 0 only, or read after the "
                                "split); build it normally and load with sw.load_pretrained")
        found = experts_modules(model, self.experts)
        problem = self._problem(model, found, size)
        if bundle.stages is not None:  # a stage may hold only dense layers: every rank agrees
            ensure_process_group(env)
            if not all_agree(env, problem is None):
                raise ConflictError(problem or f"{self!r}: refused on the ranks of another "
                                    "pipeline stage (their error names the experts module)")
            if all_agree(env, not found):
                raise ConflictError(self._none_found(model))
        elif not found:
            raise ConflictError(self._none_found(model))
        elif problem:
            raise ConflictError(problem)
        refuse_state(bundle.optimizer)
        ensure_process_group(env)
        mesh = _experts_mesh(env, layout, size)
        names = param_names(model)
        if not all(p.is_meta for p in model.parameters()):  # a meta model: shapes only
            model.to(env.device)
            if layout is not None and layout.tp * layout.cp > 1:
                # tensor- or context-parallel partners compute the same tokens: their experts
                # start from the stage's first rank, as tensor_parallel's other weights do
                _same_experts(found, stage_peers(bundle.mesh))
        for _, module in found:
            split_experts(module, mesh)
        rebind_optimizer(bundle.optimizer, names, model)
        self._per_tensor(bundle.optimizer)
        return bundle

    def _none_found(self, model: nn.Module) -> str:
        wanted = f"no module of class {self.experts!r}" if self.experts is not None else (
            "no experts module (one with num_experts whose forward takes hidden_states, "
            "top_k_index, top_k_weights)")
        return (f"{self!r}: {type(model).__name__} has {wanted}; declare a model's own with "
                "expert_parallel(experts=MyExperts)")

    def _problem(self, model: nn.Module, found: list[tuple[str, nn.Module]], size: int
                 ) -> str | None:
        """Why the experts ``found`` cannot be split over ``size`` ranks, or None."""
        for name, module in found:
            count = expert_count(module)
            if count % size:
                return (f"{self!r}: {name} holds {count} experts, which {size} ranks do not "
                        "divide; pick a size that divides it")
            try:
                expert_stacks(module)
            except ValueError as exc:
                return f"{self!r}: {name}: {exc}"
        return None

    def _per_tensor(self, optimizer: Any) -> None:
        """Have each param group that mixes expert stacks (DTensors) and plain tensors
        update them one at a time (``foreach=False``; torch's multi-tensor kernels take one
        kind per call).

        Raises:
            ConflictError: such a group whose ``foreach`` or ``fused`` the user set to True.
        """
        for index, group in enumerate(getattr(optimizer, "param_groups", [])):
            kinds = {is_expert_stack(p) for p in group["params"]}
            if kinds != {True, False}:
                continue
            chosen = [k for k in ("foreach", "fused") if group.get(k)]
            if chosen:
                raise ConflictError(f"{self!r}: param group {index} of "
                                    f"{type(optimizer).__name__} sets {chosen[0]}=True, whose "
                                    "kernel cannot take the expert stacks (DTensors) beside "
                                    "plain tensors; leave it unset")
            if "foreach" in group:
                group["foreach"] = False

    def describe(self, env: Env) -> str:
        return self.describe_in(env, plan_for(env, [self]))

    def describe_in(self, env: Env, plan: Plan) -> str:
        data = _data_ranks(env, plan.mesh)
        size = self.ep_size(env, plan.mesh)
        if not env.is_distributed or size == 1:
            return "one rank: every expert whole"
        copies = data // size
        groups = (f"; {copies} groups of {size} data ranks, replicas of each other (expert "
                  "gradients summed across them by all-reduce; beside shard() FSDP2 shards "
                  "each experts module across them too and averages there)") \
            if copies > 1 else ""
        return (f"experts split over {size} data ranks (1/{size} of every expert stack each, "
                "DTensors sharded on the expert dimension); each token's choices sent to their "
                "experts' ranks in its group and back by all-to-all (uneven counts); the data "
                f"ranks read different batches; expert gradients scaled to the mean over the "
                f"{data} data ranks (a group's ranks sum its tokens){groups}")


#: the public factory: the class itself, so its defaults are written once
expert_parallel = ExpertParallel


def _same_experts(found: list[tuple[str, nn.Module]], peers: Any) -> None:
    """Every rank of ``peers`` takes the first one's expert stacks (before the split)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for _, module in found:
            for param in expert_stacks(module).values():
                dist.broadcast(param.data, group=peers, group_src=0)


def _data_ranks(env: Env, layout: MeshLayout | None) -> int:
    """The ranks that read different batches (:func:`~shardwise.parallel.mesh.data_share`)."""
    return data_share(env, layout)[0]


def _experts_mesh(env: Env, layout: MeshLayout | None, size: int) -> Any:
    """The experts' mesh for this rank: its block coordinate's data ranks (the pipeline's
    mesh puts the data dimensions outermost: data rank ``d`` of block position ``c`` is rank
    ``d * block + c``) in groups of ``size``, ``(ep_replicate, ep)``: a slice of one 3-D mesh
    ``(block, ep_replicate, ep)`` every rank builds, so FSDP2 finds one parent mesh."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    block = layout.copies if layout is not None else 1
    data = env.world_size // block
    ranks = torch.arange(env.world_size).reshape(data, block).T.reshape(block, data // size, size)
    mesh = DeviceMesh(env.device.type, ranks, mesh_dim_names=("ep_block", "ep_replicate", "ep"))
    return mesh["ep_replicate", "ep"]
