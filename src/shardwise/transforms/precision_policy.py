# mixed_precision(): records the forward's precision in the plan; shardwise.precision carries it out.
"""Mixed precision: autocast for the forward, fp32 master weights, GradScaler for fp16."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise import precision as precisions
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.precision import Precision
from shardwise.transforms.base import Stage, Transform

__all__ = ["MixedPrecision", "mixed_precision"]


def _precision(value: object) -> Precision:
    # "no" is Accelerate's spelling of full precision (--mixed_precision no)
    return precisions.parse("fp32" if value == "no" else value, "mixed_precision()")


@attrs.frozen(repr=False)
class MixedPrecision(Transform):
    """Compute the forward in ``precision`` while parameters and optimizer stay fp32.

    Under :func:`shardwise.replicate` or one process the forward runs in ``torch.autocast``;
    ``"fp16"`` adds a ``torch.amp.GradScaler`` whose skipped steps the state counts.

    Args:
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (``"no"``, Accelerate's name for it,
            means ``"fp32"``).

    Raises:
        PrecisionError: an unknown name; at pipeline time, a precision the device cannot do.

    Example:
        >>> bundle = sw.pipeline(sw.mixed_precision("bf16"))(model, optimizer, loader)
    """

    precision: Precision = attrs.field(default="bf16", converter=_precision)
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "mixed_precision"

    def check(self, env: Env) -> None:
        """Raise unless ``env``'s device computes this precision."""
        precisions.check(self.precision, device=env.device, precisions=env.precisions,
                         part=repr(self))

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)  # checks the precision against the env
        scaler = precisions.grad_scaler(self.precision, bundle.env.device)
        return attrs.evolve(bundle, scaler=scaler)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, precision=self.precision)

    def describe(self, env: Env) -> str:
        return precisions.describe(self.precision, env.device)


#: the public factory: the class itself, so its defaults are written once
mixed_precision = MixedPrecision
