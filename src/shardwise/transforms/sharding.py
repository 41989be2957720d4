# shard(): fully sharded data parallelism with FSDP2's fully_shard, block by block, then the root.
"""Sharding on FSDP2."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from shardwise import precision
from shardwise._params import param_names, rebind_optimizer, refuse_state
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.distributed import ensure_process_group
from shardwise.engines import Engine, FSDPEngine, LocalEngine
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConflictError
from shardwise.meta_init import is_rank0_weights, materialise_from_rank0
from shardwise.parallel.mesh import MeshLayout, data_mesh
from shardwise.parallel.mesh import build as build_mesh
from shardwise.parallel.moe_dispatch import expert_splits, is_expert_stack
from shardwise.plan import Plan
from shardwise.policies import Policy, select
from shardwise.transforms._checks import boolean, to_policy
from shardwise.transforms.base import Distribution, plan_for

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy

__all__ = ["Shard", "shard"]


def _mesh(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, DeviceMesh):
        raise ArgumentError(f"shard() 'mesh' must be a torch DeviceMesh (got {short(value)})")


@attrs.frozen(repr=False)
class Shard(Distribution):
    """Shard parameters, gradients and optimizer state across ranks with FSDP2 ``fully_shard``.

    ``fully_shard`` is applied to each block the policy selects, deepest first, then to the
    root (whose parameters stay gathered from forward to backward, as torch recommends);
    the module changes in place and the bundle's optimizer is re-bound to the sharded
    parameters (same object, same groups). Precision comes from the plan as FSDP2's
    ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``: master weights stay
    fp32 and no autocast runs. In one process it is a no-op.

    Args:
        policy: which blocks to shard separately; default :func:`shardwise.auto`.
        reshard_after_forward: ``False`` keeps parameters gathered until backward (ZeRO-2,
            SHARD_GRAD_OP): more memory, less communication.
        mesh: a ``DeviceMesh`` to shard over; by default one over all ranks.
        replicate_across_nodes: hybrid sharding (HYBRID_SHARD): shard within a node,
            replicate across nodes, on a (nodes, ranks per node) mesh.
        sync_each_batch: with ``accumulate_gradients``, reduce-scatter every micro-batch to
            keep only sharded gradients (less memory, more communication).

    Raises:
        ValueError/TypeError: conflicting or mistyped options.

    Example:
        >>> pipe = sw.pipeline(sw.shard(sw.by_class("LlamaDecoderLayer")), sw.mixed_precision("bf16"))
    """

    splits_weights = True

    policy: Policy = attrs.field(default=None,
                                 converter=lambda value: to_policy(value, "shard"))
    reshard_after_forward: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    mesh: DeviceMesh | None = attrs.field(default=None, kw_only=True, validator=_mesh)
    replicate_across_nodes: bool = attrs.field(default=False, kw_only=True, validator=boolean)
    sync_each_batch: bool = attrs.field(default=False, kw_only=True, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.mesh is not None and self.replicate_across_nodes:
            raise ArgumentError("shard() takes either 'mesh' or 'replicate_across_nodes=True' (got "
                                "both); pass a 2-D mesh yourself, or let shard() build it")
    factory_name: ClassVar[str] = "shard"

    def mesh_dims(self) -> dict[str, int | None]:
        if self.mesh is not None:  # the user's own mesh
            return {}
        return {"dp_replicate": None, "dp_shard": None} if self.replicate_across_nodes \
            else {"dp_shard": None}

    def engine(self, env: Env, plan: Plan) -> Engine:
        """The engine this transform puts in the bundle (settings only, nothing is built)."""
        if not env.is_distributed:
            return LocalEngine()
        mesh = self._layout(env, plan)
        return FSDPEngine(mesh=mesh, policy=self.policy,
                          reshard_after_forward=self.reshard_after_forward,
                          sync_each_batch=self.sync_each_batch, offload=plan.offload,
                          tensor_parallel=plan.tensor_parallel if mesh.tp > 1 else None)

    def _layout(self, env: Env, plan: Plan) -> MeshLayout:
        """The layout this shards over: the user's own mesh's, or the plan's (the plan of
        this transform alone where none was built)."""
        if self.mesh is not None:
            return MeshLayout.of_mesh(self.mesh)
        layout = plan.mesh if plan.mesh is not None else plan_for(env, [self]).mesh
        assert layout is not None  # several processes: shard() declares a dimension
        return layout

    def excludes(self) -> dict[str, str]:
        if self.mesh is None:
            return {}
        return {"tensor_parallel": "shard(mesh=...) takes a mesh of your own, tensor_parallel "
                "needs the pipeline's (dp_shard x tp); leave mesh out, the pipeline builds it"}

    def _data_mesh(self, bundle: Bundle) -> DeviceMesh:
        """The mesh to shard over: the data dimensions of the pipeline's one mesh (with split
        layers, FSDP2 needs them and ``tp`` on one parent mesh), the user's own, or, applied
        by hand outside a pipeline, the mesh :mod:`shardwise.parallel.mesh` lays out for it."""
        if self.mesh is not None:
            return self.mesh
        mesh = bundle.mesh
        if mesh is None:
            layout = bundle.plan.mesh
            assert layout is not None  # several processes: shard() declares a dimension
            mesh = build_mesh(bundle.env, layout)
        dims = tuple(d for d in self.mesh_dims())
        names = mesh.mesh_dim_names or ()
        if any(d not in names for d in dims):
            raise ConflictError(f"{self!r}: the bundle's mesh has dimensions {names}, not "
                                f"{dims}; pass tensor_parallel and shard to one sw.pipeline(...), "
                                "which builds the mesh for both")
        return data_mesh(mesh, dims)

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, model, plan = bundle.env, bundle.model, bundle.plan
        if not env.is_distributed:
            return bundle
        # imported when first used: FSDP and DTensor take most of a second to import
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

        if isinstance(model, (FSDPModule, DistributedDataParallel)):
            raise ConflictError(f"{self!r}: the model is already a {type(model).__name__}; "
                                "pass the bare module")
        refuse_state(bundle.optimizer)
        ensure_process_group(env)
        if bundle.stages is not None:
            self._refuse_ties_across(model, bundle.stages.modules, env)
        blocks = select(self.policy, model, user=repr(self))
        names = param_names(model)
        from_rank0 = is_rank0_weights(model)
        # kept in host memory: set_model_state_dict sends it to the device piece by piece
        full = {k: v.detach().cpu() for k, v in model.state_dict().items()} \
            if from_rank0 and env.is_main else None
        offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
                                  if plan.offload else OffloadPolicy())
        common: dict[str, Any] = dict(mp_policy=precision.fsdp_policy(plan.precision),
                                      offload_policy=offload)
        # expert stacks expert_parallel split into groups that are replicas of each other:
        # FSDP2 shards each across the replicas (and averages its gradient there) first
        for split in expert_splits(model):
            split.shard_over_replicas(functools.partial(
                _fully_shard_on, fully_shard, self.reshard_after_forward, common))
        # stacks of one group over every rank: their ranks hold different experts, and the
        # dispatch gives each its gradient (nothing for FSDP2 to shard or reduce)
        experts = {p for p in model.parameters() if is_expert_stack(p)}
        options: dict[str, Any] = dict(mesh=self._data_mesh(bundle),
                                       ignored_params=experts or None, **common)
        for _, block in blocks:  # bottom-up: deepest first, then the root
            if isinstance(block, FSDPModule):  # an experts module sharded across replicas
                continue
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        # the root is needed again as soon as backward starts: keeping it gathered saves an
        # all-gather per step (torch's own default for the root). Pipeline stages: each
        # stage's module is a root (what torch's schedule runs, and syncs per batch)
        roots = bundle.stages.modules if bundle.stages is not None else [model]
        for root in roots:
            fully_shard(root, reshard_after_forward=False, **options)
        if from_rank0:
            materialise_from_rank0(model, env, full)
        rebind_optimizer(bundle.optimizer, names, model)
        return attrs.evolve(bundle, engine=self.engine(env, plan))

    def _refuse_ties_across(self, model: Any, stages: list[Any], env: Env) -> None:
        """A weight two stages of this rank share (a V-shaped schedule's tied embedding and
        head) would become two: FSDP2 shards each stage's module on its own, and the copies
        train apart (measured: 0.023 apart after 2 steps). Refused on every rank at once.

        Raises:
            ConflictError: here, or on another rank (named so).
        """
        from shardwise.distributed import all_agree

        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        owner: dict[int, int] = {}
        shared = ""
        for index, stage in enumerate(stages):
            for param in stage.parameters():
                if owner.setdefault(id(param), index) != index and not shared:
                    shared = (f"{' and '.join(names.get(id(param), ['a parameter']))} are "
                              f"one weight in stages {owner[id(param)]} and {index} of this rank")
        if all_agree(env, not shared):
            return
        where = shared or "another rank's pipeline stages share a weight (its error names it)"
        raise ConflictError(f"{self!r}: {where}; FSDP2 shards each pipeline stage on its own, "
                            "which would make two copies that train apart; untie them (e.g. "
                            "tie_word_embeddings=False), or run the pipeline over every rank "
                            "without shard() (its stages then keep one weight)")

    def describe_in(self, env: Env, plan: Plan) -> str:
        mesh = plan.mesh
        if mesh is not None and mesh.tp > 1:
            return (f"FSDP2 fully_shard on blocks chosen by {self.policy!r}, then the root, over "
                    f"the mesh's data dimension(s) {' x '.join(mesh.data_names)} "
                    f"({mesh.data_ranks(env.world_size)} ranks; each tensor-parallel part "
                    f"sharded over {mesh.size('dp_shard')})")
        if mesh is not None and mesh.copies > 1:  # pipeline stages, context-parallel groups
            zero = "ZeRO-3 (reshard after forward)" if self.reshard_after_forward else \
                "ZeRO-2 (keep parameters gathered between forward and backward)"
            across = mesh.size("dp_replicate")
            return (f"FSDP2 fully_shard on blocks chosen by {self.policy!r}, then the root; "
                    f"each part sharded over {mesh.shard_ranks} ranks (the mesh's "
                    f"{mesh.data_names[-1]}{' with cp folded in' if mesh.cp > 1 else ''}"
                    + (f", replicated over dp_replicate={across}" if across > 1 else "")
                    + f"; {mesh.describe()}); {zero}"
                    f"{'; gradients reduced every micro-batch' if self.sync_each_batch else ''}")
        return self.describe(env)

    def describe(self, env: Env) -> str:
        if not env.is_distributed:
            return "one process: nothing to shard, no wrapper"
        ranks = self._layout(env, plan_for(env, [self])).shard_ranks
        groups = "nodes" if self.replicate_across_nodes else "groups"
        spread = (f"hybrid: replicated over {env.world_size // ranks} {groups}, sharded over "
                  f"{ranks} ranks each" if ranks < env.world_size
                  else f"sharded over {env.world_size} ranks")
        zero = "ZeRO-3 (reshard after forward)" if self.reshard_after_forward else \
            "ZeRO-2 (keep parameters gathered between forward and backward)"
        sync = "; gradients reduced every micro-batch" if self.sync_each_batch else ""
        return (f"FSDP2 fully_shard on blocks chosen by {self.policy!r}, then the root; "
                f"{spread}; {zero}{sync}")


#: the public factory: the class itself, so its defaults are written once
shard = Shard


def _fully_shard_on(fully_shard: Any, reshard: bool, options: dict[str, Any], module: Any,
                    mesh: Any, placement: Any = None) -> None:
    """``fully_shard(module)`` over ``mesh`` with the pipeline's precision and offload (and
    ``placement``: FSDP2's ``shard_placement_fn``, each parameter's dimension to shard)."""
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=placement,
                **options)
