# The Transform base class and the canonical stages every pipeline applies in order.
"""What every transform shares: its stage, its description, the applied-twice check."""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import attrs

from shardwise.bundle import Bundle, Plan
from shardwise.env import Env
from shardwise.errors import ConflictError

__all__ = ["Stage", "Transform"]


class Stage(enum.IntEnum):
    """The canonical order. Settings first, so every later stage can read them from the plan;
    surgery before distribution, because wrappers (DDP, FSDP2) must see the final module tree;
    placement after distribution, because fully_shard places its own shards and DDP is built
    on a module that ``replicate`` moved first; the optimizer stage after placement, because
    a sharded optimizer partitions parameters that must already be on their device; data
    last, as it needs the final env and device.
    """

    SETTINGS = 1
    SURGERY = 2
    DISTRIBUTION = 3
    PLACEMENT = 4
    OPTIMIZER = 5
    DATA = 6


class Transform:
    """Base of all transforms: a frozen record with settings, called as ``t(bundle) -> Bundle``."""

    stage: ClassVar[Stage]

    def __call__(self, bundle: Bundle) -> Bundle:
        raise NotImplementedError

    def describe(self, env: Env) -> str:
        """One line saying what this transform will do under ``env``."""
        return repr(self)

    def __repr__(self) -> str:
        return factory_repr(type(self).factory_name, self)

    factory_name: ClassVar[str]

    def _record(self, bundle: Bundle, **plan_changes: Any) -> Bundle:
        """A new bundle whose plan records this transform (and ``plan_changes``).

        Raises:
            ConflictError: a transform of the same kind was applied to this bundle already,
                or one of a later stage (the canonical order is checked here).
        """
        for earlier in bundle.plan.applied:
            if type(earlier) is type(self):
                raise ConflictError(
                    f"{self!r} cannot be applied: {earlier!r} was applied to this bundle "
                    "already; apply each transform once, with the settings you want")
            if earlier.stage > self.stage:
                order = ", ".join(s.name.lower() for s in Stage)
                raise ConflictError(
                    f"{self!r} ({self.stage.name.lower()}) cannot be applied after {earlier!r} "
                    f"({earlier.stage.name.lower()}): transforms apply in the order {order}; "
                    "apply it first, or let sw.pipeline(...) order them")
        plan: Plan = attrs.evolve(bundle.plan, applied=(*bundle.plan.applied, self),
                                  **plan_changes)
        return attrs.evolve(bundle, plan=plan)


def factory_repr(name: str, obj: object) -> str:
    """``name(field=value, ...)`` for an attrs instance: the repr of the public factory call."""
    args = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in attrs.fields(type(obj)))  # type: ignore[arg-type]
    return f"{name}({args})"
