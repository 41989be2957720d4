# Precision: the one place a precision name becomes dtypes, autocast, FSDP2's policy and the scaler.
"""Everything shardwise decides about numeric precision, asked by every other module.

A precision is a name: ``"fp32"``, ``"bf16"`` or ``"fp16"``. This module says which names a
device computes (:func:`supported`), refuses the others (:func:`check`), and turns a name
into the torch objects that carry it out: the dtype, the forward's autocast context, FSDP2's
``MixedPrecisionPolicy`` and, for fp16, a ``GradScaler``. Parameters, gradients and
optimizer state stay fp32 in every case (master weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch

from shardwise._text import short
from shardwise.errors import PrecisionError

__all__ = ["Precision", "NAMES", "TRAINER_DEFAULT", "dtype", "parse", "supported", "default",
           "check", "autocast", "fsdp_policy", "grad_scaler", "describe"]

Precision = Literal["fp32", "bf16", "fp16"]
#: The accepted names, in the order they are listed to users.
NAMES: tuple[Precision, ...] = get_args(Precision)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of a precision name."""
    return _DTYPES[precision]


def parse(value: Any, where: str) -> Precision:
    """``value`` as a precision name, or a :class:`PrecisionError` naming ``where``."""
    if value not in NAMES:
        raise PrecisionError(f"{where} got precision={short(value)}; accepted: "
                             f"{', '.join(repr(n) for n in sorted(NAMES))}")
    return value


def supported(device: torch.device) -> tuple[Precision, ...]:
    """The precisions ``device`` computes natively enough to train in."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return ("fp32", "bf16", "fp16")
        return ("fp32", "fp16")
    if device.type in ("xpu", "mps"):
        return ("fp32", "bf16", "fp16")
    # fp16 autocast on a CPU is slow and GradScaler's fp16 path is not supported there
    return ("fp32", "bf16")


#: What a Transformers ``TrainingArguments`` trains in when neither ``bf16`` nor ``fp16`` is set.
TRAINER_DEFAULT: Precision = "fp32"


def default(device: torch.device, precisions: tuple[str, ...]) -> tuple[Precision, str]:
    """The precision a pipeline trains in when none is given, and why: bf16 on a CUDA device
    that computes it natively, else fp32 (a CPU's bf16 autocast is slower than fp32)."""
    if device.type == "cuda" and "bf16" in precisions:
        return "bf16", f"default: {device} computes bf16 natively"
    return "fp32", f"default: {device} has no fast native bf16"


def check(precision: Precision, *, device: torch.device, precisions: tuple[str, ...],
          part: str) -> None:
    """Raise unless a device that computes ``precisions`` can run ``precision``.

    Raises:
        PrecisionError: naming ``part``, the device and what it supports.
    """
    if precision not in precisions:
        raise PrecisionError(
            f"{part} asks for {short(precision)}, but {device} supports only "
            f"{', '.join(repr(p) for p in precisions)}; use one of those"
            + (" (fp16 needs a CUDA device)" if precision == "fp16" else ""))


def autocast(precision: Precision,
             device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """A zero-argument factory of the forward's autocast context, or ``None`` for fp32."""
    if precision == "fp32":
        return None
    kind, cast = device.type, dtype(precision)

    def context() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(kind, dtype=cast)

    return context


def fsdp_policy(precision: Precision) -> Any:
    """FSDP2's ``MixedPrecisionPolicy``: parameters cast for compute, reductions and master
    weights in fp32 (no autocast needed)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype(precision), reduce_dtype=torch.float32)


def grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """The loss scaler fp16 needs (its skipped steps are counted), else ``None``."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def describe(precision: Precision, device: torch.device) -> str:
    """One line on how ``precision`` is carried out: by autocast, or by FSDP2's casting."""
    if precision == "fp32":
        return "fp32 throughout"
    extra = "; fp16 loss scaling with GradScaler" if precision == "fp16" else ""
    return (f"forward under autocast({device.type}, {precision}), or under shard() FSDP2 "
            f"parameters cast to {precision} with fp32 reductions; fp32 master weights{extra}")
