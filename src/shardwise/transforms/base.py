# The Transform base class and the canonical stages every pipeline applies in order.
"""What every transform shares: its stage, its description, the applied-twice check."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.engines import Engine
from shardwise.env import Env
from shardwise.errors import ConflictError
from shardwise.parallel.mesh import layout_of
from shardwise.plan import Plan

__all__ = ["Stage", "Transform", "Distribution", "plan_of", "plan_for", "check_combination"]


class Stage(enum.IntEnum):
    """The canonical order. Settings first, so every later stage can read them from the plan;
    pipeline parallelism next (torchtitan's order): it cuts the model into stages, and each
    rank keeps only its stages' layers, which expert, tensor and context parallelism then
    split; expert parallelism before tensor parallelism (its experts modules become DTensors
    on the experts' own mesh, which tensor parallelism then leaves alone);
    tensor parallelism before surgery (torchtitan's order): it splits the user's layers as
    they are, and activation checkpointing then wraps the split blocks' forwards; compile
    after checkpointing (a block is compiled with its recomputation) and before the
    distribution wrappers (FSDP2's hooks stay outside the compiled regions); surgery
    before distribution, because wrappers (DDP, FSDP2) must see the final module tree;
    fault tolerance right after distribution (it continues the engine the distribution
    transform chose across torchft's replica groups); placement after distribution,
    because fully_shard places its own shards and DDP is built
    on a module that ``replicate`` moved first; the optimizer stage after placement, because
    a sharded optimizer partitions parameters that must already be on their device; data
    last, as it needs the final env and device.
    """

    SETTINGS = 1
    PIPELINE_PARALLEL = 2
    EXPERT_PARALLEL = 3
    TENSOR_PARALLEL = 4
    SURGERY = 5
    COMPILE = 6
    DISTRIBUTION = 7
    FAULT_TOLERANCE = 8
    PLACEMENT = 9
    OPTIMIZER = 10
    DATA = 11


class Transform:
    """Base of all transforms: a frozen record with settings, called as ``t(bundle) -> Bundle``."""

    stage: ClassVar[Stage]
    #: whether it decides how the model is spread over the ranks or kept in step across
    #: them (a layout of its own: the lifecycle tests must cover it)
    distributes: ClassVar[bool] = False
    #: whether it leaves each rank a part of the model's weights (it accepts a model whose
    #: parameters are on the meta device: ``init_on_meta(weights=)`` reads the parts after)
    splits_weights: ClassVar[bool] = False
    #: whether the optimizer keeps its own implementation beside it (no switch to a fused
    #: kernel): "always", "distributed" (with several processes), or None
    keeps_optimizer: ClassVar[str | None] = None

    def __call__(self, bundle: Bundle) -> Bundle:
        """Apply this transform: a new bundle (the torch objects inside may change in place)."""
        raise NotImplementedError

    def describe(self, env: Env) -> str:
        """One line saying what this transform will do under ``env``."""
        return repr(self)

    def describe_in(self, env: Env, plan: Plan) -> str:
        """:meth:`describe` under a pipeline whose settings are ``plan`` (what a transform
        does may depend on others: ``shard()`` after ``tensor_parallel``)."""
        return self.describe(env)

    def check(self, env: Env) -> None:
        """Raise if this transform cannot run under ``env`` (checked when the pipeline is
        built and again when the transform is applied)."""

    def mesh_dims(self) -> dict[str, int | None]:
        """The mesh dimensions this transform runs on, each with the size it asks for (None:
        the size :mod:`shardwise.parallel.mesh` works out); {} when it needs no mesh. The pipeline
        builds one mesh from every transform's."""
        return {}

    def needs(self) -> dict[str, str]:
        """Factory names of transforms this one needs beside it, each with what to do."""
        return {}

    def excludes(self) -> dict[str, str]:
        """Factory names of transforms this one cannot be combined with, each with why."""
        return {}

    def conflicts_with(self, other: Transform) -> str | None:
        """Why this transform cannot run beside ``other`` with ``other``'s settings (None: it
        can); for a rule on a setting, where :meth:`excludes` refuses a whole kind."""
        return None

    def record(self, plan: Plan) -> Plan:
        """``plan`` with this transform's settings recorded (only settings-stage transforms
        record any); pure, so a pipeline's plan is known before it is applied."""
        return plan

    def __repr__(self) -> str:
        return factory_repr(type(self).factory_name, self)

    factory_name: ClassVar[str]

    def _record(self, bundle: Bundle) -> Bundle:
        """A new bundle whose plan records this transform (:meth:`record`, and ``applied``).

        Raises:
            ConflictError: one of a later stage was applied already (the canonical order is
                checked here), or :func:`check_combination` refuses the combination.
        """
        applied = bundle.plan.applied
        for earlier in applied:
            if earlier.stage > self.stage:
                order = ", ".join(s.name.lower() for s in Stage)
                raise ConflictError(
                    f"{self!r} ({self.stage.name.lower()}) cannot be applied after {earlier!r} "
                    f"({earlier.stage.name.lower()}): transforms apply in the order {order}; "
                    "apply it first, or let sw.pipeline(...) order them")
        check_combination([*applied, self], applied=True)
        self.check(bundle.env)
        plan = attrs.evolve(self.record(bundle.plan), applied=(*bundle.plan.applied, self))
        if plan.mesh is None and bundle.env.is_distributed and self.mesh_dims():
            # applied by hand: the layout of what is applied so far (a pipeline gives its own)
            plan = attrs.evolve(plan, mesh=layout_of(bundle.env, plan.applied))
        return attrs.evolve(bundle, plan=plan)


class Distribution(Transform):
    """Base of the distribution transforms: each puts one engine in the bundle."""

    stage: ClassVar[Stage] = Stage.DISTRIBUTION
    distributes: ClassVar[bool] = True

    def engine(self, env: Env, plan: Plan) -> Engine:
        """The engine this transform puts in the bundle under ``env`` and ``plan``, as
        settings only (nothing is built): the memory estimate asks it too."""
        raise NotImplementedError


def plan_of(transforms: Iterable[Transform], plan: Plan | None = None) -> Plan:
    """The plan ``transforms`` record, in canonical order, without applying them."""
    for transform in sorted(transforms, key=lambda t: t.stage):
        plan = transform.record(plan or Plan())
    return plan or Plan()


def plan_for(env: Env, transforms: Iterable[Transform]) -> Plan:
    """The plan of ``transforms`` under ``env`` with its mesh layout: the one place the
    layout is worked out (a transform left at ``size=None`` is sized here, beside the
    others). The pipeline, ``explain()`` and the memory estimate take it from here.

    Raises:
        EnvError: the world does not divide into the groups the transforms ask for.
    """
    transforms = list(transforms)
    return attrs.evolve(plan_of(transforms), mesh=layout_of(env, transforms))


def factory_repr(name: str, obj: object) -> str:
    """``name(field=value, ...)`` for an attrs instance: the repr of the public factory call."""
    args = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in attrs.fields(type(obj)))  # type: ignore[arg-type]
    return f"{name}({args})"


def check_combination(parts: list[Transform], *, applied: bool = False) -> None:
    """The one place the rules between transforms are checked: each kind at most once, at
    most one distribution transform, and each transform's :meth:`~Transform.excludes`,
    :meth:`~Transform.conflicts_with` and :meth:`~Transform.needs`. ``applied``: ``parts``
    were applied to a bundle by hand, in order (needs are checked once the distribution stage
    has passed).

    Raises:
        ConflictError: naming both parts and what to do.
    """
    seen: dict[type, Transform] = {}
    for part in parts:
        earlier = seen.setdefault(type(part), part)
        if earlier is not part:
            where = (f"{earlier!r} was applied to this bundle already" if applied
                     else "the same transform given twice")
            raise ConflictError(f"{earlier!r} and {part!r}: {where}; keep one, with the "
                                "settings you want")
    distribution = [p for p in parts if p.stage == Stage.DISTRIBUTION]
    if len(distribution) > 1:
        raise ConflictError(f"{distribution[0]!r} and {distribution[1]!r} both distribute the "
                            "model; a pipeline takes at most one distribution transform")
    by_name = {type(p).factory_name: p for p in parts}
    for part in parts:
        for name, why in part.excludes().items():
            if name in by_name:
                raise ConflictError(f"{part!r} and {by_name[name]!r}: {why}")
        for other in parts:
            conflict = part.conflicts_with(other) if other is not part else None
            if conflict is not None:
                raise ConflictError(f"{part!r} and {other!r}: {conflict}")
    if applied and not any(p.stage > Stage.DISTRIBUTION for p in parts):
        return
    for part in parts:
        for name, why in part.needs().items():  # "a|b": either of them
            if not any(one in by_name for one in name.split("|")):
                asked = " or ".join(f"{one}()" for one in name.split("|"))
                raise ConflictError(f"{part!r} needs {asked}: {why}")
