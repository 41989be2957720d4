# offload(): keep parameters, gradients and the optimizer step on the CPU (through shard()).
"""CPU offload, carried out by :func:`shardwise.shard` with FSDP2's ``CPUOffloadPolicy``."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.transforms._checks import boolean
from shardwise.transforms.base import Stage, Transform

__all__ = ["Offload", "offload"]


@attrs.frozen(repr=False)
class Offload(Transform):
    """Keep sharded parameters, gradients and the optimizer step in host memory.

    Carried out by :func:`shardwise.shard` through FSDP2's ``CPUOffloadPolicy`` (pinned
    memory only where CUDA exists). ``offload(cpu=False)`` is an explicit no-op. A pipeline
    with ``offload()`` and no ``shard()`` is refused.

    Example:
        >>> pipe = sw.pipeline(sw.shard(), sw.offload())
    """

    cpu: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "offload"

    def needs(self) -> dict[str, str]:
        if not self.cpu:
            return {}
        return {"shard": "FSDP2 carries out the offload. Add sw.shard() to the pipeline, or "
                         "remove offload()"}

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, offload=self.cpu)

    def describe(self, env: Env) -> str:
        if not self.cpu:
            return "no offload (explicitly off)"
        pin = "pinned" if env.device.type == "cuda" else "unpinned (no CUDA here)"
        return (f"FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer step "
                f"on the CPU, {pin} host memory")


#: the public factory: the class itself, so its defaults are written once
offload = Offload
