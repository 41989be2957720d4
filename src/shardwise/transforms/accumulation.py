# accumulate_gradients(): several micro-batches per optimizer step, gradients synced on the last.
"""Gradient accumulation."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.plan import Plan
from shardwise.transforms._checks import boolean, integer_at_least_one
from shardwise.transforms.base import Stage, Transform

__all__ = ["AccumulateGradients", "accumulate_gradients"]


@attrs.frozen(repr=False)
class AccumulateGradients(Transform):
    """Step the optimizer once every ``steps`` calls of ``bundle.step``.

    Each call is one micro-batch. Gradients are all-reduced only on the last micro-batch of
    a window (DDP ``no_sync`` before it), and the update equals one step on the window's
    concatenated micro-batches: a scalar loss is divided by ``steps``; a loss function that
    returns ``(loss_sum, num_items)`` is divided by the items of the whole window on all ranks.

    By default a window also closes at the end of each epoch of ``bundle.loader``, as
    Accelerate does (``sync_with_dataloader=True``): the last, partial window of an epoch is
    applied, normalised by what it really holds (a scalar loss by its number of
    micro-batches, a ``(loss_sum, num_items)`` loss by its items), so the step count and
    the result per epoch do not depend on where windows fall, and N ranks still match one
    process. With ``sync_with_dataloader=False`` windows run on across epochs and a partial
    window at the very end of training is not applied. Batches that do not come from
    ``bundle.loader`` (a loop over your own iterable) have no epoch end: windows run on.

    Args:
        steps: micro-batches per optimizer step, >= 1.
        sync_with_dataloader: close the window at the end of each epoch of the loader.

    Raises:
        ValueError: ``steps`` is not an integer >= 1.

    Example:
        >>> pipe = sw.pipeline(sw.accumulate_gradients(4))
    """

    steps: int = attrs.field(validator=integer_at_least_one)
    sync_with_dataloader: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    stage: ClassVar[Stage] = Stage.SETTINGS
    factory_name: ClassVar[str] = "accumulate_gradients"

    def __call__(self, bundle: Bundle) -> Bundle:
        return self._record(bundle)

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, accumulation_steps=self.steps,
                            close_at_epoch_end=self.sync_with_dataloader)

    def describe(self, env: Env) -> str:
        sync = "; gradients synchronised on the last only" if env.is_distributed else ""
        end = ("; a window also closes at the end of each epoch (partial window normalised "
               "by what it holds)" if self.sync_with_dataloader
               else "; windows run on across epochs")
        return f"optimizer steps every {self.steps} micro-batches{sync}{end}"


#: the public factory: the class itself, so its defaults are written once
accumulate_gradients = AccumulateGradients
