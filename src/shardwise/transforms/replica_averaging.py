# local_sgd(): each replica steps on its own gradients; parameters averaged every k optimizer steps.
"""Local SGD on DDP replicas (Accelerate's ``LocalSGD`` as a transform)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.errors import ArgumentError
from shardwise.plan import Plan
from shardwise.transforms._checks import integer_at_least_one
from shardwise.transforms.base import Stage, Transform

__all__ = ["LocalSGD", "local_sgd", "average_replicas"]


@attrs.frozen(repr=False)
class LocalSGD(Transform):
    """Train each :func:`shardwise.replicate` replica on its own gradients and average the
    replicas' parameters every ``every`` optimizer steps.

    Gradients are never all-reduced (DDP ``no_sync`` on every micro-batch): a token-weighted
    loss is normalised by this rank's items, the finiteness check and clipping see this
    rank's gradients, and each rank's optimizer keeps its own state. At every ``every``-th
    optimizer step (counted over the run, so a resumed run averages where the uninterrupted
    one did) the parameters are averaged over the ranks in one all-reduce per dtype, and at
    the end of each epoch of ``bundle.loader`` (as Accelerate's ``LocalSGD`` averages when
    its context, which wraps an epoch in its example, exits); :func:`average_replicas` does
    it on demand (before evaluating in a loop of your own).
    ``sw.save``, ``sw.export`` and the end of ``sw.fit`` are synchronisation points too:
    parameters and optimizer state are averaged there, so a checkpoint is the one state every
    rank resumes from. Accelerate's ``LocalSGD`` counts its ``step()`` calls (one per batch
    in its example) and averages only parameters, also at the end of its context.

    Beside :func:`shardwise.fault_tolerant` the replicas are the replica groups instead
    (each group keeps its own layout, synchronous inside): every ``every``-th step the groups
    in torchft's quorum average their parameters, and a group lost meanwhile costs the
    survivors nothing but that average. With ``outer`` (DiLoCo) they average the change
    since the last average instead (the pseudo-gradient) and ``outer``'s optimizer applies
    it to the last average, e.g. ``outer=lambda params: torch.optim.SGD(params, lr=0.7,
    momentum=0.9, nesterov=True)``; an average torchft does not commit leaves plain local
    SGD's parameters local, and DiLoCo's back at the last average.

    Args:
        every: optimizer steps between averages, >= 1.
        outer: DiLoCo's outer optimizer, built from a list of tensors (each rank's part of
            every parameter): needs ``fault_tolerant()``.

    Raises:
        ValueError: ``every`` is not an integer >= 1, or ``outer`` is not callable.
        ConflictError: neither ``replicate()`` nor ``fault_tolerant()`` in the pipeline,
            ``outer`` without ``fault_tolerant()``, or ``shard_optimizer()`` (which would
            broadcast parameters every step).

    Example:
        >>> pipe = sw.pipeline(sw.replicate(), sw.local_sgd(every=8))
    """

    every: int = attrs.field(validator=integer_at_least_one)
    outer: Any = attrs.field(default=None, kw_only=True)
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "local_sgd"
    distributes: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        if self.outer is not None and not callable(self.outer):
            raise ArgumentError(f"local_sgd(outer={short(self.outer)}): accepted: a callable "
                                "that builds the outer optimizer from a list of tensors")

    def needs(self) -> dict[str, str]:
        if self.outer is not None:
            return {"fault_tolerant": "outer= (DiLoCo) averages replica groups; add "
                                      "sw.fault_tolerant() to the pipeline"}
        return {"replicate|fault_tolerant": "local SGD averages DDP replicas or torchft's "
                                            "replica groups; add sw.replicate() or "
                                            "sw.fault_tolerant() to the pipeline"}

    def excludes(self) -> dict[str, str]:
        return {"shard_optimizer": "ZeRO-1 broadcasts the updated parameters every step, "
                                   "which local SGD must not; drop one"}

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, local_sgd_every=self.every, local_sgd_outer=self.outer)

    def describe_in(self, env: Env, plan: Plan) -> str:
        if plan.fault_tolerant is None:
            return self.describe(env)
        outer = ("; DiLoCo: the change since the last average is averaged and the outer "
                 "optimizer applies it" if self.outer is not None else "")
        return (f"local SGD across torchft's replica groups: each group trains on its own "
                f"(synchronous inside), the groups' parameters averaged every {self.every} "
                f"optimizer step(s){outer}")

    def describe(self, env: Env) -> str:
        if not env.is_distributed:
            return "one process: nothing to average"
        return (f"local SGD: gradients stay on each of {env.world_size} ranks; parameters "
                f"averaged every {self.every} optimizer step(s), and parameters and optimizer "
                "state at sw.save, sw.export and the end of sw.fit")


#: the public factory: the class itself, so its defaults are written once
local_sgd = LocalSGD


def average_replicas(bundle: Bundle, *, optimizer_state: bool = False) -> None:
    """Average the replicas that :func:`local_sgd` lets drift apart, now: the parameters (and
    with ``optimizer_state`` the optimizer's state too), over every rank. Every rank must
    call it (a collective); under any other layout it does nothing.

    Call it before evaluating or predicting in a loop of your own between averages, so every
    rank evaluates one model; ``sw.save``, ``sw.export``, the end of an epoch of
    ``bundle.loader`` and the end of ``sw.fit`` do it already.

    Example:
        >>> sw.average_replicas(bundle)
        >>> metrics = sw.evaluate(bundle)
    """
    bundle.engine.synchronise_replicas(bundle.model,
                                       bundle.optimizer if optimizer_state else None)
