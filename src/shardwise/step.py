# The training step: forward, backward, sync, clip, optimizer and scheduler step, zero_grad.
"""The step behind ``Bundle.step``; everything that can be decided once is decided here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from shardwise import precision as precisions
from shardwise.data import DeviceLoader, same_batch, to_device
from shardwise.distributed import collective_failure
from shardwise.engines.base import Engine
from shardwise.engines.step_hooks import (
    Micro,
    StepRun,
    WindowEnd,
    call_model,
    no_items_text,
    nonfinite_text,
)
from shardwise.env import Env
from shardwise.errors import NonFiniteError, OptimizerError
from shardwise.parallel.context_split import ContextSplit
from shardwise.parallel.pp_schedule import PipelineRun
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, StepOutput, TrainState, check_on_nonfinite
from shardwise.throughput import batch_counts

__all__ = ["Stepper", "call_model", "predict"]


def forward_autocast(engine: Engine, precision: precisions.Precision, device: torch.device
                     ) -> Any:
    """The autocast factory a forward runs under: none where the engine casts parameters
    (FSDP2) or for fp32."""
    return None if engine.casts_parameters else precisions.autocast(precision, device)


def predict(model: torch.nn.Module, batch: Any, *, precision: precisions.Precision, env: Env,
            engine: Engine, move: bool = False, context: ContextSplit | None = None,
            stages: PipelineRun | None = None) -> Any:
    """The model's output without gradients, in eval mode, at the training precision (under
    context parallelism: each rank its slice, the outputs gathered whole; under pipeline
    parallelism: through the stages, the last one's output on every rank)."""
    if move and env.device.type != "cpu":
        batch = to_device(batch, env.device)
    autocast = forward_autocast(engine, precision, env.device)
    run = call_model if context is None else context.predict
    if stages is not None:
        run = lambda model, batch: stages.predict(batch)  # noqa: E731
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if autocast is None:
                return run(model, batch)
            with autocast():
                return run(model, batch)
    finally:
        model.train(was_training)


class Stepper:
    """The skeleton of ``Bundle.step``: where a micro-batch stands in its epoch and window,
    the batch moved and checked, the engine's two hooks (:meth:`Engine.backward` and, at a
    window's end, :meth:`Engine.end_window`), and the next :class:`TrainState` and the
    :class:`StepOutput`, built here once for every engine.

    Built from the bundle's fields and holding nothing that changes between calls: what must
    survive from one micro-batch to the next is in the TrainState, so two steppers over the
    same objects train identically.
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any, scaler: torch.amp.GradScaler | None, loss_fn: LossFn | None,
                 loader: Any, env: Env, plan: Plan, engine: Engine,
                 context: ContextSplit | None = None, stages: PipelineRun | None = None) -> None:
        if optimizer is None:
            raise OptimizerError("step() needs an optimizer: pass one to the pipeline call")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # gradients arrive averaged over the ranks a wrapper synchronises; the ranks of a
        # tensor-parallel group read the same batch, so counts summed over all ranks hold
        # each batch that often (a context-parallel group's ranks count their own slices)
        joined = dist.is_initialized()
        copies = plan.size("tp") if joined else 1
        if context is not None:  # each rank the loss of its slice, as a (sum, count)
            user = loss_fn

            def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
                return context.loss(model, batch, user)
        self.run = StepRun(
            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            loss_fn=loss_fn, plan=plan, env=env,
            autocast=forward_autocast(engine, plan.precision, env.device), params=params,
            param_device=engine.local(params[0]).device if params else env.device,
            copies=plan.copies if joined else 1,
            # each stage of a pipeline counts the batch's tokens (shared over the group)
            synced=engine.gradient_ranks(env) * copies * (stages.size if stages else 1)
            if joined else 1, stages=stages)
        self.engine = engine
        self.loader = loader if isinstance(loader, DeviceLoader) else None
        # batches per epoch of bundle.loader (None: unknown, no epoch ends are seen)
        self.epoch_length = self.loader.epoch_length() if self.loader is not None else None
        self.move = loader is None and env.device.type != "cpu"

    def settle(self, state: TrainState, micro: int) -> None:
        """Read ``state``'s pending check (an earlier step's); raise if that step was not
        finite (its update was skipped on the device), after clearing the gradients this
        call accumulated. The error carries the state to continue from."""
        pending = state.pending_check
        if pending is not None and pending.failed():
            run = self.run
            run.optimizer.zero_grad(set_to_none=True)
            run.labelled = None  # this call's count belongs to no window now
            stepped = " (the scheduler had stepped)" if run.scheduler is not None else ""
            empty = no_items_text(pending.step, pending.micro_step, pending.items, pending.reduce)
            remedy = ("Check the labels and masks of these batches (a prompt mask or truncation "
                      "can hide every token), or pass on_nonfinite='skip' to skip such steps"
                      if empty is not None else "Pass on_nonfinite='skip' to skip such steps, "
                      "or lower the learning rate / add clip_gradients")
            raise NonFiniteError(
                (empty or nonfinite_text(pending.step, pending.micro_step)) + "its update was "
                f"skipped on the device, parameters and optimizer state are as before "
                f"it{stepped}; seen at micro-step {micro}. {remedy}; exc.state continues "
                "without it",
                state=attrs.evolve(state, pending_check=None,
                                   skipped_steps=state.skipped_steps + 1))

    def position(self, state: TrainState) -> tuple[int, int, bool]:
        """The data position after this batch, and whether it ended an epoch: one batch on
        (the first of the epoch the loader has just begun, if it began one). The end of
        epoch E is position (E + 1, 0), where the loader goes on."""
        loader = self.loader
        if loader is not None and loader.epoch != state.epoch:
            epoch, done = loader.epoch, loader.batch_in_epoch
        else:
            epoch, done = state.epoch, state.batch_in_epoch + 1
        if done == self.epoch_length:
            return epoch + 1, 0, True
        return epoch, done, False

    def window_size(self, state: TrainState, epoch_end: bool, batch_in_epoch: int) -> int:
        """Micro-batches in the current window: the full window, or fewer when the epoch
        ends first (known when the loader's epoch length is)."""
        window = self.run.window
        if not self.run.plan.close_at_epoch_end or self.epoch_length is None:
            return window
        index = self.epoch_length - 1 if epoch_end else batch_in_epoch - 1
        start = index - state.window_batches
        return max(1, min(window, self.epoch_length - start))

    @contextlib.contextmanager
    def naming_failures(self, state: TrainState, micro: int) -> Iterator[None]:
        """A collective that timed out or lost a peer inside, raised as the
        :class:`~shardwise.errors.CollectiveError` naming the step, micro-step and phase."""
        try:
            yield
        except RuntimeError as exc:
            failure = collective_failure(
                exc, f"optimizer step {state.step + 1} (micro-step {micro}), {self.run.phase}"
            ) if self.run.env.is_distributed else None
            if failure is None:
                raise
            raise failure from exc

    def step(self, state: TrainState, batch: Any,
             on_nonfinite: OnNonFinite | None) -> tuple[TrainState, StepOutput]:
        if on_nonfinite is not None:
            check_on_nonfinite(on_nonfinite, "step()", allow_none=True)
        run, engine = self.run, self.engine
        batches = state.window_batches + 1
        epoch, batch_in_epoch, epoch_end = self.position(state)
        micro = Micro(index=state.micro_step + 1, batches=batches,
                      size=self.window_size(state, epoch_end, batch_in_epoch),
                      boundary=batches == run.window or (epoch_end and run.plan.close_at_epoch_end),
                      epoch_end=epoch_end, on_nonfinite=on_nonfinite or run.plan.on_nonfinite)
        if self.move:
            batch = to_device(batch, run.env.device)
        if run.copies > 1 and state.micro_step == 0:
            run.phase = "checking the first batch across a tensor- or context-parallel group"
            with self.naming_failures(state, micro.index):
                same_batch(batch, run.copies, run.env.device)
        # the rate this call's update uses: read before the scheduler steps at the window's end
        lr = run.optimizer.param_groups[0].get("lr")
        with self.naming_failures(state, micro.index):
            done = engine.backward(run, state, batch, micro)
            # read after this call's work is queued: the device has long finished that check
            if state.pending_check is not None:
                self.settle(state, micro.index)
            end = WindowEnd()
            if micro.boundary:
                try:
                    end = engine.end_window(run, state, done, micro)
                except NonFiniteError as exc:  # raised at the step: its window is gone
                    exc.state = TrainState(
                        step=state.step + 1, micro_step=micro.index, epoch=epoch,
                        batch_in_epoch=batch_in_epoch, skipped_steps=state.skipped_steps + 1,
                        synced=state.synced or done.synced)
                    engine.after_window(run, exc.state)  # replicas' averages stay in step
                    raise
        boundary = micro.boundary
        next_state = TrainState(
            step=state.step + boundary, micro_step=micro.index, epoch=epoch,
            batch_in_epoch=batch_in_epoch, skipped_steps=state.skipped_steps + end.skipped,
            window_batches=0 if boundary else batches,
            window_items=None if boundary else done.total,
            window_weighted=None if boundary else done.weighted,
            window_losses=None if boundary else done.losses,
            synced=state.synced or done.synced, pending_check=end.pending)
        if boundary:
            with self.naming_failures(state, micro.index):
                engine.after_window(run, next_state)
        samples, tokens = batch_counts(batch)
        return next_state, StepOutput(loss=done.loss, grad_norm=end.norm,
                                      stepped=boundary and not end.skipped, lr=lr,
                                      samples=samples, tokens=tokens)
