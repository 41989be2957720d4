# mixed_precision(): the one owner of precision — autocast dtype and the fp16 gradient scaler.
"""Mixed precision: autocast for the forward, fp32 master weights, GradScaler for fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar, get_args

import attrs
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from shardwise.bundle import Bundle
from shardwise.env import Env, Precision
from shardwise.errors import PrecisionError
from shardwise.transforms.base import Stage, Transform

__all__ = [
    "MixedPrecision", "mixed_precision", "autocast_factory", "compute_dtype", "fsdp_policy",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of a precision name; the only place names become dtypes."""
    return _DTYPES[precision]


def autocast_factory(precision: Precision,
                     device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """A zero-argument factory of the forward's autocast context, or ``None`` for fp32."""
    if precision == "fp32":
        return None
    dtype, kind = compute_dtype(precision), device.type

    def context() -> contextlib.AbstractContextManager[None]:
        return torch.autocast(kind, dtype=dtype)

    return context


def fsdp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision``: parameters cast for compute, reductions and master
    weights in fp32 (no autocast needed)."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)


def check_precision(precision: str, env: Env, part: str) -> None:
    """Raise unless ``env``'s device can compute in ``precision``."""
    if precision not in env.precisions:
        raise PrecisionError(
            f"{part} asks for {precision!r}, but {env.device} supports only "
            f"{', '.join(repr(p) for p in env.precisions)}; use one of those"
            + (" (fp16 needs a CUDA device)" if precision == "fp16" else ""))


@attrs.frozen(repr=False)
class MixedPrecision(Transform):
    """See :func:`mixed_precision`."""

    precision: Precision
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "mixed_precision"

    def __call__(self, bundle: Bundle) -> Bundle:
        check_precision(self.precision, bundle.env, repr(self))
        scaler = None
        if self.precision == "fp16":
            scaler = torch.amp.GradScaler(bundle.env.device.type)
        return attrs.evolve(self._record(bundle, precision=self.precision), scaler=scaler)

    def describe(self, env: Env) -> str:
        if self.precision == "fp32":
            return "fp32 throughout"

        extra = "; fp16 loss scaling with GradScaler" if self.precision == "fp16" else ""
        return (f"forward under autocast({env.device.type}, {self.precision}), or under shard() "
                f"FSDP2 parameters cast to {self.precision} with fp32 reductions; fp32 master "
                f"weights{extra}")


def mixed_precision(precision: Precision = "bf16") -> MixedPrecision:
    """Compute the forward in ``precision`` while parameters and optimizer stay fp32.

    Under :func:`shardwise.replicate` or one process the forward runs in ``torch.autocast``;
    ``"fp16"`` adds a ``torch.amp.GradScaler`` whose skipped steps the state counts.

    Args:
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    Raises:
        PrecisionError: an unknown name; at pipeline time, a precision the device cannot do.

    Example:
        >>> bundle = sw.pipeline(sw.mixed_precision("bf16"))(model, optimizer, loader)
    """
    if precision not in get_args(Precision):
        raise PrecisionError(
            f"mixed_precision() got precision={precision!r}; accepted: 'bf16', 'fp16', 'fp32'")
    return MixedPrecision(precision)
