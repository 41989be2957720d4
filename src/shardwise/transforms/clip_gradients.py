# clip_gradients(): clip the total gradient norm before each optimizer step.
"""Gradient clipping."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.transforms.base import Stage, Transform

__all__ = ["ClipGradients", "clip_gradients"]


@attrs.frozen(repr=False)
class ClipGradients(Transform):
    """See :func:`clip_gradients`."""

    max_norm: float
    norm_type: float = 2.0
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "clip_gradients"

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, max_grad_norm=self.max_norm, norm_type=self.norm_type)

    def describe(self, env: Env) -> str:
        return f"clip the total {self.norm_type}-norm of the gradients to {self.max_norm}"


def clip_gradients(max_norm: float, *, norm_type: float = 2.0) -> ClipGradients:
    """Clip the total gradient norm to ``max_norm`` on every optimizer step.

    The step reports the norm before clipping as ``StepOutput.grad_norm``.

    Args:
        max_norm: the largest total norm allowed, > 0.
        norm_type: the p of the p-norm, > 0 or ``math.inf``.

    Raises:
        ValueError: a non-positive or non-numeric value.

    Example:
        >>> pipe = sw.pipeline(sw.clip_gradients(1.0))
    """
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"clip_gradients() '{name}' must be a number > 0 (got {value!r})")
    if math.isnan(max_norm):
        raise ValueError("clip_gradients() 'max_norm' must be a number > 0 (got nan)")
    return ClipGradients(float(max_norm), float(norm_type))
