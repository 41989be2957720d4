# Bundle (model, optimizer, loader, scheduler, env, plan) and Plan, the settings later stages read.
"""The bundle a pipeline returns, and its plan."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from shardwise.env import Env, Precision, detect
from shardwise.state import StepOutput, TrainState

if TYPE_CHECKING:
    from shardwise.step import Stepper

__all__ = ["Bundle", "Plan", "OnNonFinite", "LossFn"]

OnNonFinite = Literal["raise", "skip"]
#: ``loss_fn(model, batch)`` returns a scalar loss, or ``(loss_sum, num_items)``.
LossFn = Callable[[torch.nn.Module, Any], Any]


@attrs.frozen
class Plan:
    """Settings recorded by the settings-stage transforms and read by later stages and the step.

    Attributes:
        precision: compute precision of the forward ("fp32", "bf16", "fp16").
        accumulation_steps: micro-batches per optimizer step.
        max_grad_norm: clip the total gradient norm to this, or ``None``.
        norm_type: the p of the p-norm used for clipping.
        on_nonfinite: what a NaN/inf loss or gradient does in fp32/bf16.
        offload: parameters, gradients and the optimizer step live on the CPU (needs shard).
        autocast: the step runs the forward under autocast (off when FSDP2 casts parameters).
        sync_each_batch: reduce gradients on every micro-batch, not only on a window's last.
        applied: the transforms applied so far, in order.
    """

    precision: Precision = "fp32"
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    on_nonfinite: OnNonFinite = "raise"
    offload: bool = False
    autocast: bool = True
    sync_each_batch: bool = False
    applied: tuple[Any, ...] = ()


@attrs.frozen
class Bundle:
    """Model, optimizer, loader and scheduler made ready for ``env``, with the step that trains them.

    ``sharded_optimizer`` is the ZeRO-1 engine :func:`shardwise.shard_optimizer` adds; the
    step drives it with the hyperparameters of ``optimizer``, which stays the user's object.

    A pipeline returns one; a transform takes one and returns a new one. The torch objects
    inside change in place where torch works that way (DDP wrapping, moving to a device):
    do not use a bundle again after passing it to a transform.

    Example:
        >>> bundle = sw.pipeline(sw.detect())(model, optimizer, loader)
        >>> state = bundle.init()
        >>> for batch in bundle.loader:
        ...     state, out = bundle.step(state, batch)
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    loader: Iterable[Any] | None = None
    scheduler: Any = None
    env: Env = attrs.field(factory=detect)
    plan: Plan = attrs.field(factory=Plan)
    loss_fn: LossFn | None = None
    scaler: torch.amp.GradScaler | None = None
    sharded_optimizer: torch.optim.Optimizer | None = None

    def init(self) -> TrainState:
        """A fresh :class:`TrainState` at step 0."""
        return TrainState()

    def step(self, state: TrainState, batch: Any, *,
             on_nonfinite: OnNonFinite | None = None) -> tuple[TrainState, StepOutput]:
        """Train on one micro-batch; step the optimizer on the last micro-batch of a window.

        Args:
            state: the state returned by the previous call (or :meth:`init`).
            batch: a batch from ``bundle.loader`` (already on the device).
            on_nonfinite: override the plan's "raise"/"skip" for this call.

        Returns:
            The next state and this call's :class:`StepOutput`.

        Raises:
            LossError: no loss could be found; pass ``loss_fn``.
            NonFiniteError: a non-finite loss/gradient under ``on_nonfinite="raise"``.
        """
        return self._stepper.step(state, batch, on_nonfinite)

    @functools.cached_property
    def _stepper(self) -> Stepper:
        from shardwise.step import Stepper

        return Stepper(self)
