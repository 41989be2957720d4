# clip_gradients(): clip the total gradient norm before each optimizer step.
"""Gradient clipping."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.transforms._checks import positive_float
from shardwise.transforms.base import Stage, Transform

__all__ = ["ClipGradients", "clip_gradients"]


@attrs.frozen(repr=False)
class ClipGradients(Transform):
    """Clip the total gradient norm to ``max_norm`` on every optimizer step.

    The step reports the norm before clipping as ``StepOutput.grad_norm``.

    Args:
        max_norm: the largest total norm allowed, > 0.
        norm_type: the p of the p-norm, > 0 or ``math.inf``.

    Raises:
        ArgumentError: a non-positive, non-finite (max_norm) or non-numeric value.

    Example:
        >>> pipe = sw.pipeline(sw.clip_gradients(1.0))
    """

    max_norm: float = attrs.field(
        converter=lambda value: positive_float(value, "clip_gradients", "max_norm"))
    norm_type: float = attrs.field(
        default=2.0, kw_only=True,
        converter=lambda value: positive_float(value, "clip_gradients", "norm_type",
                                     infinite=True))
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "clip_gradients"

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, max_grad_norm=self.max_norm, norm_type=self.norm_type)

    def describe(self, env: Env) -> str:
        return f"clip the total {self.norm_type}-norm of the gradients to {self.max_norm}"


#: the public factory: the class itself, so its defaults are written once
clip_gradients = ClipGradients
