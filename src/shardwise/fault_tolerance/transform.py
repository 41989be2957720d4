# fault_tolerant(): data parallelism across torchft replica groups that survives losing one.
"""The ``fault_tolerant()`` transform (optional: ``pip install 'shardwise[ft]'``)."""

from __future__ import annotations

import socket
from typing import Any, ClassVar

import attrs

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.errors import ArgumentError, FaultToleranceError
from shardwise.plan import Plan
from shardwise.transforms._checks import integer_at_least_one, positive_number
from shardwise.transforms.base import Stage, Transform

__all__ = ["FaultTolerant", "fault_tolerant", "EXTRA", "GROUP_VAR", "GROUPS_VAR"]

EXTRA = "pip install 'shardwise[ft]'"
#: torchft's names (its examples'): this group's id, and how many groups split the data
GROUP_VAR = "REPLICA_GROUP_ID"
GROUPS_VAR = "NUM_REPLICA_GROUPS"


def _optional_group(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or \
            value < (0 if attribute.name == "group" else 1):
        raise ArgumentError(f"fault_tolerant({attribute.name}={short(value)}): accepted: None or "
                            f"an integer >= {0 if attribute.name == 'group' else 1}")


def _given(name: str, value: int | None) -> int:
    if value is None:
        raise FaultToleranceError(
            f"fault_tolerant(): {name} is not set and no value was given; set {GROUP_VAR} "
            f"(0 .. {GROUPS_VAR} - 1, one per replica group) and {GROUPS_VAR} for every process, "
            "or pass group= and groups=")
    return value


@attrs.frozen(repr=False)
class FaultTolerant(Transform):
    """Continue data parallelism across replica groups on torchft, so that losing a group
    costs the step in flight, not a restart of the job.

    Each replica group is its own torchrun job (its own ranks, store and in-group layout:
    one process, ``replicate()``, ``shard()``, ``tensor_parallel()``); a torchft lighthouse
    (``shardwise lighthouse --port P --min-replicas N``) forms a quorum of the live groups
    for every optimizer step. Gradients are averaged over the groups in the quorum (each
    rank with the same rank of the other groups), and the update is applied only where
    torchft commits it: a step in which a group was lost is discarded by the survivors,
    who go on with a smaller quorum while at least ``min_replicas`` groups are live. A
    restarted group joins at ``bundle.init()`` (or ``sw.load``) and heals there from a live
    peer: weights, optimizer and scheduler state, and the data position, sent rank to rank
    without a collective.

    The data is split over ``groups`` x the group's data ranks, as torchft's
    ``DistributedSampler``: group g always reads share g, so a lost group's batches of the
    steps it missed are not trained, and a healed group reads on from its peers' position.

    Args:
        min_replicas: live groups a step needs to be applied.
        group: this group's id, 0 .. groups - 1 (None: ``REPLICA_GROUP_ID``).
        groups: the groups the data is split over (None: ``NUM_REPLICA_GROUPS``).
        timeout: seconds a cross-group all-reduce, commit or heal may take.
        quorum_timeout: seconds to wait for a quorum.
        hostname: the address other groups reach this one at (None: the host's name).
        max_discarded: updates in a row the quorum may discard before the group stops with
            an error (a quorum that never commits would move the data on without training).

    Raises:
        FaultToleranceError: torchft is not installed (naming the extra), the group's id or
            count is missing or out of range, or no lighthouse address is set.

    Example:
        >>> pipe = sw.pipeline(sw.shard(), sw.fault_tolerant(min_replicas=1))
    """

    min_replicas: int = attrs.field(default=1, validator=integer_at_least_one)
    group: int | None = attrs.field(default=None, kw_only=True, validator=_optional_group)
    groups: int | None = attrs.field(default=None, kw_only=True, validator=_optional_group)
    timeout: float = attrs.field(default=60.0, kw_only=True, validator=positive_number)
    quorum_timeout: float = attrs.field(default=60.0, kw_only=True, validator=positive_number)
    hostname: str | None = attrs.field(default=None, kw_only=True)
    max_discarded: int = attrs.field(default=20, kw_only=True, validator=integer_at_least_one)
    stage: ClassVar[Stage] = Stage.FAULT_TOLERANCE
    factory_name: ClassVar[str] = "fault_tolerant"
    distributes: ClassVar[bool] = True

    def excludes(self) -> dict[str, str]:
        why = ("is not carried across replica groups yet (only one process, replicate(), "
               "shard() and tensor_parallel() run inside a group); drop one")
        return {name: f"{name}() {why}" for name in
                ("deepspeed", "shard_optimizer", "pipeline_parallel", "context_parallel",
                 "expert_parallel")}

    def replica(self, env: Env) -> tuple[int, int]:
        """``(group, groups)``: this group's id and the groups the data is split over (the
        transform's, else ``env``'s, from torchft's variables).

        Raises:
            FaultToleranceError: either is missing, or the id is not below the count.
        """
        group = _given(GROUP_VAR, self.group if self.group is not None else env.replica_group)
        groups = _given(GROUPS_VAR, self.groups if self.groups is not None
                        else env.replica_groups)
        if not 0 <= group < groups:
            raise FaultToleranceError(
                f"fault_tolerant(): replica group {group} of {groups}; accepted: 0 .. "
                f"{groups - 1} ({GROUP_VAR} below {GROUPS_VAR})")
        return group, groups

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, fault_tolerant=self)

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        try:
            import torchft  # noqa: F401  (the optional extra)
        except ImportError as exc:
            raise FaultToleranceError(f"fault_tolerant() needs torchft ({exc}); {EXTRA}") from None
        from shardwise.engines import DDPEngine
        from shardwise.fault_tolerance.engine import FaultTolerantEngine, Replicas

        group, groups = self.replica(bundle.env)
        plan = bundle.plan
        replicas = Replicas(group=group, groups=groups, timeout=self.timeout,
                            quorum_timeout=self.quorum_timeout,
                            hostname=self.hostname or socket.gethostname(),
                            every=plan.local_sgd_every, outer_factory=plan.local_sgd_outer,
                            max_discarded=self.max_discarded)
        inner = bundle.engine
        if isinstance(inner, DDPEngine) and inner.local_sgd_every:
            # local SGD's replicas are the groups: DDP inside averages every step
            inner = attrs.evolve(inner, local_sgd_every=None)
        engine = FaultTolerantEngine(inner=inner, replicas=replicas,
                                     min_replicas=self.min_replicas)
        return attrs.evolve(bundle, engine=engine)

    def describe(self, env: Env) -> str:
        try:
            group, groups = self.replica(env)
            which, split = f"group {group} of {groups}", f"{groups} groups'"
        except FaultToleranceError:
            which, split = f"the group {GROUP_VAR} names, of {GROUPS_VAR}", "groups'"
        return (f"torchft across replica groups ({which}, each of {env.world_size} rank(s)): "
                f"gradients averaged over each step's quorum of live groups (at least "
                f"{self.min_replicas}); a step a group is lost in is discarded and the "
                "survivors go on; a restarted group heals from a live peer at bundle.init(); "
                f"data split over the {split} shares, a lost group's batches not trained")


#: the public factory: the class itself, so its defaults are written once
fault_tolerant = FaultTolerant
