# StepHooks: the two hooks of the step an engine owns (a micro-batch's backward, a window's end).
"""What an engine does inside ``Bundle.step``, with the native implementation as default.

The step's skeleton (:class:`shardwise.step.Stepper`) decides where a micro-batch stands,
moves and checks the batch, and builds the next :class:`~shardwise.state.TrainState` and the
:class:`~shardwise.state.StepOutput`. Between those it calls the engine twice:

- :meth:`StepHooks.backward`: forward and backward of one micro-batch, inside the engine's
  control of gradient synchronisation;
- :meth:`StepHooks.end_window`: at a window's last micro-batch, the reduction and
  normalisation of the window's gradients, clipping, the finiteness check and the
  optimizer step;
- :meth:`StepHooks.after_window`: once the window's next state is built (a no-op but for
  local SGD across torchft's replica groups, which averages there).

The native engines (one process, DDP, FSDP2, tensor parallel) share the implementation
here and override only small questions (:meth:`~StepHooks.no_sync`, :meth:`~StepHooks.clip`,
:meth:`~StepHooks.local`, :meth:`~StepHooks.stepping_optimizer`); an engine that drives
training itself (DeepSpeed) overrides the two hooks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from shardwise._params import is_dtensor
from shardwise.device_skip import defer, ready_to_skip, skips_on_device
from shardwise.engines.grad_norm import clip_across_meshes
from shardwise.env import Env
from shardwise.errors import LossError, NonFiniteError
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, PendingCheck, TrainState

#: the label that marks a token as not learned from (torch's cross_entropy default, and
#: Transformers' prompt and padding mask)
IGNORE = -100

__all__ = ["StepHooks", "StepRun", "Micro", "Backward", "WindowEnd", "NoSync", "call_model",
           "forward", "nonfinite_text"]

#: A zero-argument factory of the context that skips gradient reduction for one micro-batch.
NoSync = Callable[[], contextlib.AbstractContextManager[Any]]


@attrs.define(eq=False)
class StepRun:
    """What every call of the step works on, built once per bundle. Holds no progress
    (that is in the TrainState): only the bundle's objects, what follows from them, constant
    tensors of 1 (one per device) and the phase a failed collective is named by."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    loss_fn: LossFn | None
    plan: Plan
    env: Env
    #: the forward's autocast factory (None: none, the engine casts parameters or fp32)
    autocast: Any
    params: list[torch.Tensor]
    #: where the optimizer updates (the CPU under offload): the flag it takes must be there
    param_device: torch.device
    #: ranks that read each batch (a pp x cp x tp block: checked at the first step), and
    #: the ranks the step's collectives run over (gradient ranks × tensor-parallel copies ×
    #: pipeline stages)
    copies: int
    synced: int
    #: this rank's pipeline stages (``pipeline_parallel``): the batch runs through their
    #: schedule, forward and backward together; None without
    stages: Any = None
    units: dict[torch.device, torch.Tensor] = attrs.Factory(dict)
    phase: str = ""
    #: the labelled tokens (labels other than -100) of this rank's batches in the window so
    #: far, when the model computes its own (mean) loss; read only to explain a failed step
    labelled: torch.Tensor | None = None

    @property
    def window(self) -> int:
        """Micro-batches in a full accumulation window."""
        return self.plan.accumulation_steps


@attrs.frozen
class Micro:
    """Where one call of the step stands.

    Attributes:
        index: the micro-step it makes (counted over the run, this one included).
        batches: micro-batches of its window so far, this one included.
        size: micro-batches its window holds: the plan's, or fewer where an epoch ends
            first (known when the loader's epoch length is).
        boundary: it closes its window (the optimizer steps).
        epoch_end: it is the last batch of an epoch.
        on_nonfinite: what a non-finite window does, for this call.
    """

    index: int
    batches: int
    size: int
    boundary: bool
    epoch_end: bool
    on_nonfinite: OnNonFinite


@attrs.frozen
class Backward:
    """What one micro-batch's backward leaves for the state and the window's end.

    Attributes:
        loss: the loss to report (detached; per item when the loss is a sum).
        total: the window's item count so far (None: plain losses, or the engine counts).
        weighted: whether the window's losses are (sum, count) pairs (None: not tracked).
        losses: the window's sum of losses so far (None: not tracked).
        synced: gradients were synchronised in this backward.
    """

    loss: torch.Tensor
    total: torch.Tensor | None = None
    weighted: bool | None = None
    losses: torch.Tensor | None = None
    synced: bool = True


@attrs.frozen
class WindowEnd:
    """What a window's end did: the norm before clipping, whether the update was skipped,
    and a finiteness check left to read later."""

    norm: torch.Tensor | None = None
    skipped: bool = False
    pending: PendingCheck | None = None


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.ndim == 0:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"could not find a loss in the model's output of type {type(out).__name__}: "
            "the step looks for out.loss, out['loss'] or a scalar tensor; pass "
            "loss_fn=lambda model, batch: ... to the pipeline call")
    return loss


def _sum_and_count(result: tuple[Any, ...]) -> tuple[torch.Tensor, Any]:
    """Check a ``(loss_sum, num_items)`` pair from ``loss_fn``."""
    count = result[1] if len(result) == 2 else None
    countable = isinstance(count, (int, float)) and not isinstance(count, bool) or (
        isinstance(count, torch.Tensor) and count.numel() == 1)
    if not countable or not isinstance(result[0], torch.Tensor) or result[0].ndim != 0:
        shown = ", ".join(type(v).__name__ if not isinstance(v, torch.Tensor)
                          else f"Tensor{tuple(v.shape)}" for v in result)
        raise LossError(f"loss_fn returned a tuple ({shown}); accepted: a scalar loss tensor, "
                        "or (loss_sum, num_items) with a scalar loss_sum and a number or "
                        "one-element tensor num_items")
    return result[0], count


def forward(run: StepRun, batch: Any) -> tuple[torch.Tensor, Any]:
    """The loss of one micro-batch, and the item count when ``loss_fn`` returns a sum."""
    if run.loss_fn is not None:
        result = run.loss_fn(run.model, batch)
        if isinstance(result, tuple):
            return _sum_and_count(result)
        return _loss_of(result), None
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor):  # a device reduction, never read unless it fails
        count = (labels != IGNORE).sum()
        run.labelled = count if run.labelled is None else run.labelled + count
    return _loss_of(call_model(run.model, batch)), None


def window_count(run: StepRun, total: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """The window's item count for :func:`no_items_text` (the weighted total, reduced over
    the ranks already; else the labelled tokens the model's own loss saw on this rank), and
    whether it still needs reducing; the model-loss count starts again."""
    labelled, run.labelled = run.labelled, None
    if total is not None:
        return total, False
    return labelled, run.synced > 1


def _collective_device() -> torch.device:
    """Where a tensor for a collective of the default group lives (NCCL: this GPU)."""
    if torch.cuda.is_available() and dist.get_backend() != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def no_items_text(step: int, micro: int, total: torch.Tensor | None,
                  reduce: bool = False) -> str | None:
    """When the window's item count (over every rank) is zero, why the step is not finite,
    in words the same on every layout: every label of it is -100, so its loss is 0/0 (the
    learning rate is not the cause); else None. A host read (and, with ``reduce``, a
    collective every rank reaches: they agreed the step failed), made only once it failed."""
    if reduce:  # every rank reaches this (the flag says so on all): counted or not
        device = total.device if total is not None else _collective_device()
        counted = total.double() if total is not None else torch.zeros((), dtype=torch.float64,
                                                                      device=device)
        pair = torch.stack([counted, torch.tensor(float(total is not None), dtype=torch.float64,
                                                  device=device)])
        dist.all_reduce(pair)
        if int(pair[1].item()) != dist.get_world_size():
            return None  # some rank's batches had no labels to count
        total = pair[0]
    if total is None:
        return None
    if bool(total.item() != 0):
        return None
    return (f"optimizer step {step} (micro-step {micro}): its window holds no labelled token "
            "on any rank (every label is -100, or every item masked), so its loss is a sum "
            "over nothing divided by 0 and its gradients are not finite; ")


def nonfinite_text(step: int, micro: int) -> str:
    """The opening of every non-finite error: which step and micro-step."""
    return (f"non-finite gradients at optimizer step {step} (micro-step {micro}), or a "
            "non-finite loss or item count in its window, on some rank; ")


class StepHooks:
    """The step's two hooks with the native implementation, and the small questions it asks
    the engine (each with one process's answer)."""

    def gradient_ranks(self, env: Env) -> int:
        """How many ranks' gradients arrive averaged in ``.grad`` after a synchronised backward."""
        return 1

    def syncs_gradients(self) -> bool:
        """Whether a window's last micro-batch synchronises gradients (False: local SGD, every
        micro-batch runs under :meth:`no_sync`)."""
        return True

    def no_sync(self, model: nn.Module, state: TrainState) -> NoSync | None:
        """The context that skips gradient reduction for a micro-batch before a window's last,
        or None when this micro-batch must synchronise (or there is nothing to skip)."""
        return None

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a gradient or parameter: a DTensor's local shard (FSDP2,
        tensor parallel), any other tensor itself."""
        return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor: a DTensor gathered from every rank (a collective), any other
        tensor itself."""
        return tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]

    def clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the gradients of ``params`` to a total norm of ``max_norm``; return the norm
        before clipping, whole on every rank. DTensors beside plain tensors or on several
        meshes (expert stacks ``expert_parallel`` split) take the norm across meshes (torch's
        stacks one kind on one mesh)."""
        meshes = {id(p.device_mesh) if is_dtensor(p) else None for p in params}  # type: ignore[attr-defined]
        if len(meshes) > 1:
            return clip_across_meshes(params, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return self.full(norm)

    def stepping_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose ``step()`` updates the parameters, given the current
        hyperparameters of the user's ``optimizer`` (which is it, by default)."""
        return optimizer

    # -- the hooks ------------------------------------------------------------------------

    def backward(self, run: StepRun, state: TrainState, batch: Any, micro: Micro) -> Backward:
        """Forward and backward of one micro-batch, gradient reduction skipped (no_sync)
        before a window's last micro-batch where the engine can."""
        no_sync = None if micro.boundary and self.syncs_gradients() else \
            self.no_sync(run.model, state)
        run.phase = "forward and backward"
        if no_sync is None:
            return _backward(run, state, batch, synced=True)
        with no_sync():
            return _backward(run, state, batch, synced=False)

    def end_window(self, run: StepRun, state: TrainState, done: Backward, micro: Micro
                   ) -> WindowEnd:
        """Finish a window: normalise, unscale, clip, check, step the optimizer and the
        scheduler, zero the gradients.

        Under "raise", with an optimizer that skips on the device (torch's fused kernels),
        the finiteness flag goes to the optimizer and is read later, unless the window ends
        an epoch; "skip", fp16 and other optimizers read it here, one host sync.

        Raises:
            NonFiniteError: a non-finite window under "raise" (nothing was applied).
        """
        optimizer, scaler = run.optimizer, run.scaler
        stepping = self.stepping_optimizer(optimizer)
        count, reduce = window_count(run, done.total)
        if scaler is not None:
            scaler.unscale_(stepping)
        if done.total is not None:
            run.phase = "all-reduce of the window's item count"
            self._normalise(run, done.total)
        elif micro.batches < run.window:  # each loss was divided by the full window
            grads = [self.local(p.grad) for p in run.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, run.window / micro.batches)
        run.phase = "finiteness check and clipping (all-reduce)"
        assert done.losses is not None  # the native backward always tracks them
        norm, flag = self._check(run, done.losses)
        run.phase = "optimizer step"
        if (not micro.epoch_end and micro.on_nonfinite == "raise" and scaler is None
                and flag.device == run.param_device  # offloaded: no copy racing the kernel
                and skips_on_device(stepping) and ready_to_skip(stepping)):
            stepping.found_inf = flag  # type: ignore[attr-defined]
            try:
                stepping.step()
            finally:
                del stepping.found_inf  # type: ignore[attr-defined]
            if run.scheduler is not None:
                run.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return WindowEnd(norm, False, defer(flag, state.step + 1, state.micro_step + 1,
                                                count, reduce))
        finite = flag.item() == 0
        if scaler is not None:  # fp16: the scaler's skip, never an error
            if finite:
                scaler.step(stepping)
            scaler.update()
        elif finite:
            stepping.step()
        elif micro.on_nonfinite == "raise":
            optimizer.zero_grad(set_to_none=True)
            empty = no_items_text(state.step + 1, state.micro_step + 1, count, reduce)
            raise NonFiniteError(
                empty + "nothing was applied. Check the labels and masks of these batches (a "
                "prompt mask or truncation can hide every token), or pass on_nonfinite='skip' "
                "to skip such steps" if empty is not None else
                nonfinite_text(state.step + 1, state.micro_step + 1) + "nothing was applied. "
                "Pass on_nonfinite='skip' to skip such steps, or lower the learning rate / add "
                "clip_gradients")
        if finite and run.scheduler is not None:
            run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return WindowEnd(norm, not finite)

    def after_window(self, run: StepRun, state: TrainState) -> None:
        """After a window ended and ``state`` (the one ``step()`` returns) was built: what
        must see the finished step's state (replicas averaged across groups); nothing by
        default."""

    def _normalise(self, run: StepRun, total: torch.Tensor) -> None:
        """Divide summed gradients by the items of the whole window on all ranks."""
        if run.synced > 1:
            dist.all_reduce(total)
        grads = [self.local(p.grad) for p in run.params if p.grad is not None]
        factor = (run.synced / total).to(torch.float32)
        torch._foreach_mul_(grads, factor.to(grads[0].device) if grads else factor)

    def _check(self, run: StepRun, losses: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Clip when the plan says so; return (norm before clipping or None, a flag on the
        device: nonzero when a gradient or the window's ``losses`` (their sum) is not finite).

        Nothing is read on the host. Without clipping torch's fused check (the one GradScaler
        uses, with a scale of 1) gives finiteness in one call, the losses' sum included. With
        several ranks the flag is reduced once over all of them (MAX): a loss differs per
        rank, and so does a shard's gradient; so all ranks agree.
        """
        plan = run.plan
        if plan.max_grad_norm is not None:
            norm = self.clip(run.params, plan.max_grad_norm, plan.norm_type) if run.stages is None \
                else clip_across_meshes(run.params, plan.max_grad_norm, plan.norm_type,
                                        stages=run.stages.size)
            bad = ~torch.isfinite(norm) | ~torch.isfinite(losses).to(norm.device)
            flag = bad.to(run.env.device if run.synced > 1 else norm.device, torch.float32)
            if run.synced > 1:  # on the backend's device (NCCL), also for offloaded gradients
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return norm, flag
        # this rank's part of each gradient: one reduction below serves shards and losses
        grads = [self.local(p.grad) for p in run.params if p.grad is not None]
        device = grads[0].device if grads else losses.device
        if device not in run.units:
            run.units[device] = torch.ones((), device=device)
        unit = run.units[device]
        flag = torch.zeros((), device=device)  # new each step: a pending check keeps it
        # the losses' sum joins the same call where it can (scaled by 1, unchanged); the
        # check sets the flag to 1.0, never adds: a fused kernel skips only on exactly 1.0
        joins = losses.device == device and losses.is_floating_point() and all(
            g.dtype == torch.float32 for g in grads[:1])
        checked = [*grads, losses.float()] if joins else grads
        if checked:
            torch._amp_foreach_non_finite_check_and_unscale_(checked, flag, unit)
        if not joins:
            flag.add_((~torch.isfinite(losses)).to(device, torch.float32)).clamp_(max=1.0)
        if run.synced > 1:
            flag = flag.to(run.env.device)  # offloaded gradients: the backend's device (NCCL)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return None, flag


def _backward(run: StepRun, state: TrainState, batch: Any, *, synced: bool) -> Backward:
    """Forward and backward of one micro-batch: the loss to report, the window's item count
    and form, and the window's sum of losses (non-finite when a loss or a count was), this
    one counted."""
    run_batch = forward if run.stages is None else lambda run, batch: run.stages.train(batch)
    if run.autocast is None:  # under pipeline_parallel the schedule runs backward too
        loss, items = run_batch(run, batch)
    else:
        with run.autocast():
            loss, items = run_batch(run, batch)
    weighted = items is not None
    if state.window_weighted is not None and state.window_weighted != weighted:
        raise LossError("loss_fn returned (loss_sum, num_items) for some micro-batches of a "
                        "window and a plain loss for others; return one form always")
    total = state.window_items
    # the window's losses summed: a NaN or inf in any stays in the sum, which the
    # gradients' finiteness check reads with them (no extra host sync)
    seen = loss.detach()
    if weighted:
        if not isinstance(items, torch.Tensor) and not (math.isfinite(items) and items >= 0):
            raise LossError(f"loss_fn returned num_items={items!r}; it must be a finite "
                            "count >= 0")
        count = torch.as_tensor(items, dtype=torch.float64, device=loss.device).reshape(())
        if isinstance(items, torch.Tensor):  # checked on the device, like the loss
            seen = seen + torch.where(count >= 0, count * 0, torch.nan).to(seen.dtype)
        # a new tensor: the window's total is all-reduced in place, the user's must not be
        total = count.clone() if total is None else total + count
        # a micro-batch (or a context-parallel slice) with no labelled token reports 0, not 0/0
        report = loss.detach() / count.clamp(min=1).to(loss.dtype)
    else:
        report = loss.detach()
        if run.window > 1:
            loss = loss / run.window
    if run.stages is None:
        if run.scaler is not None:
            loss = run.scaler.scale(loss)
        loss.backward()
    if state.window_losses is not None:
        seen = seen + state.window_losses.to(seen.device)
    return Backward(report, total, weighted, seen, synced)
