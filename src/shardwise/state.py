# TrainState, the immutable record threaded through step(), and StepOutput, what a step returns.
"""Training state and step output."""

from __future__ import annotations

from typing import Any

import attrs
import torch

__all__ = ["TrainState", "StepOutput"]


@attrs.frozen
class TrainState:
    """Where training stands; a new record after every ``step()``.

    ``step`` counts completed accumulation windows (optimizer updates, including those
    skipped for non-finite values, which ``skipped_steps`` counts); ``micro_step`` counts
    ``step()`` calls. ``epoch`` and ``batch_in_epoch`` follow ``bundle.loader``.

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

    def to_dict(self) -> dict[str, int]:
        """The state as a JSON-ready dict."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        """Rebuild a state written by :meth:`to_dict`; unknown keys are refused."""
        names = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"TrainState has no field(s) {unknown}; accepted: {sorted(names)}")
        return cls(**{k: int(v) for k, v in data.items()})


@attrs.frozen
class StepOutput:
    """What one ``step()`` returns. Reading ``loss`` or ``grad_norm`` as a number syncs the host.

    Attributes:
        loss: this micro-batch's loss on this rank, detached (a per-item mean when the
            loss function returns ``(loss_sum, num_items)``).
        grad_norm: total gradient norm before clipping on an optimizer step, else ``None``.
        stepped: whether the optimizer stepped on this call.
        lr: the learning rate of the first param group after this call.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    stepped: bool
    lr: float | None
