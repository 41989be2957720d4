# Bundle: model, optimizer, loader, scheduler, env, plan and engine, with the step that trains them.
"""The bundle a pipeline returns."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from shardwise._text import short
from shardwise.engines import Engine, LocalEngine
from shardwise.env import Env, detect
from shardwise.errors import ArgumentError
from shardwise.parallel.context_split import ContextSplit
from shardwise.parallel.pp_schedule import PipelineRun
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, StepOutput, TrainState
from shardwise.step import Stepper, predict

__all__ = ["Bundle", "Plan", "OnNonFinite", "LossFn"]


def _check_state(state: Any, where: str) -> None:
    if not isinstance(state, TrainState):
        raise ArgumentError(f"Bundle.{where} 'state' must be a TrainState (bundle.init(), or "
                            f"what step() returned); got {type(state).__name__}: {short(state)}")


@attrs.frozen
class Bundle:
    """Model, optimizer, loader and scheduler made ready for ``env``, with the step that trains them.

    ``eval_loader`` is distributed like ``loader`` (each rank its share, every rank the same
    number of batches; :func:`shardwise.gather_for_metrics` drops the padding).
    ``engine`` is what the distribution transform chose (one process, DDP, FSDP2): the step,
    checkpoints, export and the memory estimate ask it how to do what differs between them.

    A pipeline returns one; a transform takes one and returns a new one. The torch objects
    inside change in place where torch works that way (DDP wrapping, moving to a device):
    do not use a bundle again after passing it to a transform. The bundle holds no training
    progress: that is the :class:`TrainState` ``step()`` returns.

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
    engine: Engine = attrs.field(factory=LocalEngine)
    eval_loader: Iterable[Any] | None = None
    mesh: Any = None
    """The pipeline's ``DeviceMesh`` with named dimensions (``dp_replicate``, ``dp_shard``,
    ``tp``) when ``tensor_parallel`` is in it, else None (``shard()`` builds its own)."""
    context: ContextSplit | None = attrs.field(default=None, repr=False, eq=False)
    """This rank's slice of every sequence under :func:`shardwise.context_parallel` (the step
    and :meth:`predict` split batches with it), else None."""
    stages: PipelineRun | None = attrs.field(default=None, repr=False, eq=False)
    """This rank's pipeline stages and their schedule under
    :func:`shardwise.pipeline_parallel` (the step, :meth:`predict` and ``sw.evaluate`` run
    batches through it), else None."""
    distributor: Callable[[Any], Any] | None = attrs.field(default=None, repr=False, eq=False)
    """How :func:`shardwise.distribute_data` distributed the loaders (what
    :meth:`distribute` applies to another one); None before it ran."""

    def distribute(self, loader: Iterable[Any]) -> Any:
        """``loader`` distributed as ``eval_loader`` is: each rank its share, every rank the
        same number of batches, delivered on the device. For loaders beyond the two a
        pipeline call takes (a test set, several validation sets), each exact under
        :func:`shardwise.gather_for_metrics` (pass it the loader).

        Raises:
            ArgumentError: the bundle was built without a loader (no ``distribute_data``).
            DataError: ``loader`` cannot be split (see ``distribute_data``).

        Example:
            >>> test_loader = bundle.distribute(DataLoader(test_set, batch_size=32))
            >>> for batch in test_loader:
            ...     preds = bundle.predict(batch)
        """
        if self.distributor is None:
            raise ArgumentError("Bundle.distribute() distributes as the bundle's loaders are, "
                                "but this bundle was built without one; pass a loader (or "
                                "eval_loader) to the pipeline call, or apply "
                                "sw.distribute_data() to the bundle")
        return self.distributor(loader)

    @property
    def sharded_optimizer(self) -> torch.optim.Optimizer | None:
        """The ZeRO-1 optimizer :func:`shardwise.shard_optimizer` added, driven with the
        hyperparameters of ``optimizer`` (which stays the user's object), or None."""
        return self.engine.sharded_optimizer

    def predict(self, batch: Any) -> Any:
        """The model's output for ``batch``: no gradients, in eval mode, at the precision
        training uses under this bundle's engine (autocast, or FSDP2's parameter casting).

        The batch is passed as in :meth:`step` (``model(**batch)`` for a mapping,
        ``model(*batch)`` for a tuple or list). Train mode is restored afterwards. Under
        ``context_parallel`` each rank runs its slice and every rank gets the whole output
        (sequence dimension gathered; ``loss`` the mean over the batch's labelled tokens);
        under ``pipeline_parallel`` the batch runs through the stages and every rank of the
        group gets the last stage's output (and that loss).

        Example:
            >>> for batch in bundle.eval_loader:
            ...     logits = bundle.predict(batch)["logits"]
        """
        return predict(self.model, batch, precision=self.plan.precision, env=self.env,
                       engine=self.engine, move=self.loader is None, context=self.context,
                       stages=self.stages)

    def init(self) -> TrainState:
        """A fresh :class:`TrainState` at step 0; under :func:`shardwise.fault_tolerant` the
        group joins torchft's quorum here, and a restarted group heals from a live peer and
        gets its state (the loader positioned where the peer's data position is)."""
        return self.engine.begin(self, TrainState())

    def step(self, state: TrainState, batch: Any, *,
             on_nonfinite: OnNonFinite | None = None) -> tuple[TrainState, StepOutput]:
        """Train on one micro-batch; step the optimizer on the last micro-batch of a window.

        A function of ``(state, batch)``: what a window carries between micro-batches is in
        ``state``, so another bundle over the same objects continues it exactly.

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
        _check_state(state, "step()")
        return self._stepper.step(state, batch, on_nonfinite)

    def check(self, state: TrainState) -> TrainState:
        """Read the finiteness check ``step()`` left pending in ``state`` (see
        :class:`~shardwise.state.PendingCheck`) and return the state without it.

        Under ``on_nonfinite="raise"`` with torch's fused Adam/AdamW/SGD an optimizer step
        skips a non-finite update on the device, and the next ``step()`` (or the last step of
        an epoch, ``sw.save`` and ``sw.fit``) raises naming it. Call this after a loop you end
        yourself mid-epoch, so that its last step is checked too.

        Raises:
            NonFiniteError: that step saw a non-finite loss or gradient; its update was not
                applied. Its ``state`` is the one to continue from, if you do.
        """
        _check_state(state, "check()")
        if state.pending_check is None:
            return state
        self._stepper.settle(state, state.micro_step)
        return attrs.evolve(state, pending_check=None)

    @functools.cached_property
    def _stepper(self) -> Stepper:
        """Derived from the fields alone and holding no progress, so caching it is safe."""
        return Stepper(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                       scaler=self.scaler, loss_fn=self.loss_fn, loader=self.loader,
                       env=self.env, plan=self.plan, engine=self.engine, context=self.context,
                       stages=self.stages)
