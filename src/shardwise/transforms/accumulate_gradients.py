# accumulate_gradients(): several micro-batches per optimizer step, gradients synced on the last.
"""Gradient accumulation."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.transforms._checks import integer_at_least_one
from shardwise.transforms.base import Stage, Transform

__all__ = ["AccumulateGradients", "accumulate_gradients"]


@attrs.frozen(repr=False)
class AccumulateGradients(Transform):
    """Step the optimizer once every ``steps`` calls of ``bundle.step``.

    Each call is one micro-batch. Gradients are all-reduced only on the last micro-batch of
    a window (DDP ``no_sync`` before it), and the update equals one step on the window's
    concatenated micro-batches: a scalar loss is divided by ``steps``; a loss function that
    returns ``(loss_sum, num_items)`` is divided by the items of the whole window on all ranks.

    Windows run on across epochs: a loader that ends mid-window leaves its gradients
    accumulated, and the window completes with the next epoch's first batches. No hidden
    optimizer step is taken; a partial window at the very end of training is not applied.

    Args:
        steps: micro-batches per optimizer step, >= 1.

    Raises:
        ValueError: ``steps`` is not an integer >= 1.

    Example:
        >>> pipe = sw.pipeline(sw.accumulate_gradients(4))
    """

    steps: int = attrs.field(validator=integer_at_least_one)
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "accumulate_gradients"

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, accumulation_steps=self.steps)

    def describe(self, env: Env) -> str:
        sync = "; gradients synchronised on the last only" if env.is_distributed else ""
        return f"optimizer steps every {self.steps} micro-batches{sync}"


#: the public factory: the class itself, so its defaults are written once
accumulate_gradients = AccumulateGradients
