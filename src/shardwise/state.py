# TrainState, the immutable record threaded through step(), and StepOutput, what a step returns.
"""Training state and step output."""

from __future__ import annotations

from typing import Any, Literal, get_args

import attrs
import torch

from shardwise._text import short
from shardwise.errors import ArgumentError

__all__ = ["TrainState", "StepOutput", "PendingCheck", "PROGRESS", "OnNonFinite",
           "check_on_nonfinite"]

#: What a non-finite loss or gradient does in fp32/bf16: raise, or skip the optimizer step.
OnNonFinite = Literal["raise", "skip"]
_ON_NONFINITE = get_args(OnNonFinite)

#: The fields of :class:`TrainState` a checkpoint saves.
PROGRESS = ("step", "micro_step", "epoch", "batch_in_epoch", "skipped_steps")


@attrs.frozen(eq=False)
class PendingCheck:
    """The finiteness flag of an optimizer step whose update was applied on the device,
    skipped there if the flag was set, before the host read the flag.

    ``flag`` is host memory (pinned, filled by a non-blocking copy on an accelerator; the
    flag itself on a CPU) and ``ready`` the event that marks the copy done (None on a CPU),
    so reading it waits for that step's check alone, never for work queued after it.
    """

    step: int
    micro_step: int
    flag: torch.Tensor
    ready: Any = None
    #: the window's item count (read only once the step failed, to say why), if counted,
    #: and whether it is this rank's alone (reduced over the ranks then)
    items: torch.Tensor | None = None
    reduce: bool = False

    def failed(self) -> bool:
        """Whether the step saw a non-finite loss or gradient (its update was not applied)."""
        if self.ready is not None:
            self.ready.synchronize()
        return bool(self.flag.item() != 0)


@attrs.frozen
class TrainState:
    """Where training stands; a new record after every ``step()``.

    ``step`` counts completed accumulation windows (optimizer updates, including those
    skipped for non-finite values, which ``skipped_steps`` counts); ``micro_step`` counts
    ``step()`` calls; ``epoch`` and ``batch_in_epoch`` are the data position (the step
    advances it by one batch, and starts a new epoch when ``bundle.loader`` does; ``sw.load``
    positions the loader from it). Whatever must survive from one micro-batch to the next
    lives here too (``window_batches``, ``window_items``, ``window_weighted``, ``synced``),
    so a step is a function of ``(state, batch)`` alone.

    Example:
        >>> state = bundle.init()
        >>> for batch in bundle.loader:
        ...     state, out = bundle.step(state, batch)
        >>> state.step
        10
    """

    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0
    # Within an accumulation window (never saved: checkpoints are taken between windows).
    #: micro-batches accumulated so far in this window
    window_batches: int = 0
    #: the items counted so far in this window, when the loss is ``(loss_sum, num_items)``
    window_items: torch.Tensor | None = attrs.field(default=None, eq=False)
    #: whether this window's losses are ``(loss_sum, num_items)``; None before its first
    window_weighted: bool | None = None
    #: the sum of this window's losses, on the device: not finite when a loss (or a tensor
    #: item count, which adds NaN when negative) was not
    window_losses: torch.Tensor | None = attrs.field(default=None, eq=False)
    #: whether the model has run a synchronised backward in this process (DDP's static
    #: graph needs one before a ``no_sync`` micro-batch); not saved, it belongs to the wrapper
    synced: bool = attrs.field(default=False, eq=False)
    #: the last optimizer step's finiteness check, not yet read on the host (see
    #: :meth:`Bundle.check`); read by the next ``step()``, ``sw.save`` and ``sw.fit``
    pending_check: PendingCheck | None = attrs.field(default=None, eq=False)

    def to_dict(self) -> dict[str, int]:
        """The progress counters as a JSON-ready dict (the window fields are not saved)."""
        return {name: getattr(self, name) for name in PROGRESS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        """Rebuild a state written by :meth:`to_dict`; unknown keys are refused."""
        names = set(PROGRESS)
        unknown = sorted(set(data) - names)
        if unknown:
            raise ArgumentError(f"TrainState has no field(s) {unknown}; accepted: {sorted(names)}")
        counters: dict[str, Any] = {k: int(v) for k, v in data.items()}
        return cls(**counters)


@attrs.frozen
class StepOutput:
    """What one ``step()`` returns. Reading ``loss`` or ``grad_norm`` as a number syncs the host.

    Attributes:
        loss: this micro-batch's loss on this rank, detached (a per-item mean when the
            loss function returns ``(loss_sum, num_items)``).
        grad_norm: total gradient norm before clipping on an optimizer step, else ``None``.
        stepped: whether the optimizer stepped on this call (True also for a step whose
            update a fused kernel skipped on the device; the next call raises for it).
        lr: the learning rate of the first param group this call used (its update's, before
            the scheduler stepped), as the Trainer logs it.
        samples: samples in this rank's micro-batch (the first dimension of its first tensor).
        tokens: elements of its ``input_ids`` (None without them): with ``samples``, what
            ``sw.fit``'s throughput counts.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    stepped: bool
    lr: float | None
    samples: int = 1
    tokens: int | None = None


def check_on_nonfinite(value: Any, where: str, *, allow_none: bool = False) -> None:
    """Raise a ValueError naming ``where`` unless ``value`` is "raise" or "skip" (or None,
    where ``allow_none``)."""
    if value in _ON_NONFINITE or (allow_none and value is None):
        return
    accepted = "'raise', 'skip' or None" if allow_none else "'raise' or 'skip'"
    raise ArgumentError(f"{where} 'on_nonfinite' must be {accepted} (got {short(value)})")
