# The training step: forward, backward, sync, clip, optimizer and scheduler step, zero_grad.
"""The step behind ``Bundle.step``; everything that can be decided once is decided here."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from shardwise import precision as precisions
from shardwise.data import DeviceLoader, same_batch, to_device
from shardwise.device_skip import defer, ready_to_skip, skips_on_device
from shardwise.distributed import collective_failure
from shardwise.engines.base import Engine
from shardwise.env import Env
from shardwise.errors import LossError, NonFiniteError, OptimizerError
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, PendingCheck, StepOutput, TrainState, check_on_nonfinite

__all__ = ["Stepper", "call_model", "predict"]


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


def _nonfinite(step: int, micro: int) -> str:
    return (f"non-finite gradients at optimizer step {step} (micro-step {micro}), or a "
            "non-finite loss or item count in its window, on some rank; ")


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def forward_autocast(engine: Engine, precision: precisions.Precision, device: torch.device
                     ) -> Any:
    """The autocast factory a forward runs under: none where the engine casts parameters
    (FSDP2) or for fp32."""
    return None if engine.casts_parameters else precisions.autocast(precision, device)


def predict(model: torch.nn.Module, batch: Any, *, precision: precisions.Precision, env: Env,
            engine: Engine, move: bool = False) -> Any:
    """The model's output without gradients, in eval mode, at the training precision."""
    if move and env.device.type != "cpu":
        batch = to_device(batch, env.device)
    autocast = forward_autocast(engine, precision, env.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if autocast is None:
                return call_model(model, batch)
            with autocast():
                return call_model(model, batch)
    finally:
        model.train(was_training)


class Stepper:
    """Runs ``Bundle.step``. Built from the bundle's fields and holding nothing that changes
    between calls (only constant tensors of 1, one per device): everything that must
    survive from one micro-batch to the next is in the :class:`TrainState`, so two steppers
    over the same objects train identically.
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any, scaler: torch.amp.GradScaler | None, loss_fn: LossFn | None,
                 loader: Any, env: Env, plan: Plan, engine: Engine) -> None:
        if optimizer is None:
            raise OptimizerError("step() needs an optimizer: pass one to the pipeline call")
        self.model, self.optimizer, self.engine = model, optimizer, engine
        self.scheduler, self.scaler, self.loss_fn = scheduler, scaler, loss_fn
        self.plan, self.window = plan, plan.accumulation_steps
        self.autocast = forward_autocast(engine, plan.precision, env.device)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        # where the optimizer updates (the CPU under offload): the flag it takes must be there
        self.param_device = engine.local(self.params[0]).device if self.params else env.device
        # gradients arrive averaged over the ranks a wrapper synchronises; the ranks of a
        # tensor-parallel group (copies) read the same batch, so counts summed over all
        # ranks hold each batch that often. synced: the ranks the step's collectives run over
        joined = dist.is_initialized()
        self.copies = engine.batch_copies(env) if joined else 1
        self.synced = engine.gradient_ranks(env) * self.copies if joined else 1
        self.loader = loader if isinstance(loader, DeviceLoader) else None
        # batches per epoch of bundle.loader (None: unknown, no epoch ends are seen)
        self.epoch_length = self.loader.epoch_length() if self.loader is not None else None
        self.move = loader is None and env.device.type != "cpu"
        self.device = env.device
        self.units: dict[torch.device, torch.Tensor] = {}  # the check's scale of 1, per device
        self.phase = ""  # where in the step we are, for naming a failed collective

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """The loss, and the item count when the loss is a sum."""
        if self.loss_fn is not None:
            result = self.loss_fn(self.model, batch)
            if isinstance(result, tuple):
                return _sum_and_count(result)
            return _loss_of(result), None
        return _loss_of(call_model(self.model, batch)), None

    def backward(self, state: TrainState, batch: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None, bool, torch.Tensor]:
        """Forward and backward of one micro-batch: the loss to report, the window's item
        count and form, and the window's sum of losses (non-finite when a loss or a count
        was), this one counted."""
        if self.autocast is None:
            loss, items = self.forward(batch)
        else:
            with self.autocast():
                loss, items = self.forward(batch)
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
            report = loss.detach() / count.to(loss.dtype)
        else:
            report = loss.detach()
            if self.window > 1:
                loss = loss / self.window
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        if state.window_losses is not None:
            seen = seen + state.window_losses.to(seen.device)
        return report, total, weighted, seen

    def normalise(self, total: torch.Tensor) -> None:
        """Divide summed gradients by the items of the whole window on all ranks."""
        if self.synced > 1:
            dist.all_reduce(total)
        grads = [self.engine.local(p.grad) for p in self.params if p.grad is not None]
        factor = (self.synced / total).to(torch.float32)
        torch._foreach_mul_(grads, factor.to(grads[0].device) if grads else factor)

    def check_grads(self, losses: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Clip when the plan says so; return (norm before clipping or None, a flag on the
        device: nonzero when a gradient or the window's ``losses`` (their sum) is not finite).

        Nothing is read on the host. Without clipping torch's fused check (the one GradScaler
        uses, with a scale of 1) gives finiteness in one call, the losses' sum included. With
        several ranks the flag is reduced once over all of them (MAX): a loss differs per
        rank, and so does a shard's gradient; so all ranks agree.
        """
        plan = self.plan
        if plan.max_grad_norm is not None:
            norm = self.engine.clip(self.params, plan.max_grad_norm, plan.norm_type)
            bad = ~torch.isfinite(norm) | ~torch.isfinite(losses).to(norm.device)
            flag = bad.to(self.device if self.synced > 1 else norm.device, torch.float32)
            if self.synced > 1:  # on the backend's device (NCCL), also for offloaded gradients
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return norm, flag
        # this rank's part of each gradient: one reduction below serves shards and losses
        grads = [self.engine.local(p.grad) for p in self.params if p.grad is not None]
        device = grads[0].device if grads else losses.device
        if device not in self.units:
            self.units[device] = torch.ones((), device=device)
        unit = self.units[device]
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
        if self.synced > 1:
            flag = flag.to(self.device)  # offloaded gradients: the backend's device (NCCL)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return None, flag

    def rescale(self, factor: float) -> None:
        """Multiply the gradients by ``factor`` (a window that closed early)."""
        grads = [self.engine.local(p.grad) for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def update(self, state: TrainState, total: torch.Tensor | None, batches: int,
               losses: torch.Tensor, on_nonfinite: OnNonFinite, read_now: bool
               ) -> tuple[torch.Tensor | None, bool, PendingCheck | None]:
        """Finish a window of ``batches`` micro-batches: normalise, unscale, clip, step.
        Returns (norm, skipped, the check left to read later or None).

        Under "raise", with an optimizer that skips on the device (torch's fused kernels),
        the flag goes to the optimizer and is read later, unless ``read_now`` (an epoch's
        last step); "skip", fp16 and other optimizers read it here, one host sync.
        """
        optimizer = self.optimizer
        stepping = self.engine.stepping_optimizer(optimizer)
        if self.scaler is not None:
            self.scaler.unscale_(stepping)
        if total is not None:
            self.phase = "all-reduce of the window's item count"
            self.normalise(total)
        elif batches < self.window:  # each loss was divided by the full window
            self.rescale(self.window / batches)
        self.phase = "finiteness check and clipping (all-reduce)"
        norm, flag = self.check_grads(losses)
        self.phase = "optimizer step"
        if (not read_now and on_nonfinite == "raise" and self.scaler is None
                and flag.device == self.param_device  # offloaded: no copy racing the kernel
                and skips_on_device(stepping) and ready_to_skip(stepping)):
            stepping.found_inf = flag  # type: ignore[attr-defined]
            try:
                stepping.step()
            finally:
                del stepping.found_inf  # type: ignore[attr-defined]
            if self.scheduler is not None:
                self.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return norm, False, defer(flag, state.step + 1, state.micro_step + 1)
        finite = flag.item() == 0
        if self.scaler is not None:  # fp16: the scaler's skip, never an error
            if finite:
                self.scaler.step(stepping)
            self.scaler.update()
        elif finite:
            stepping.step()
        elif on_nonfinite == "raise":
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(_nonfinite(state.step + 1, state.micro_step + 1)
                                 + "nothing was applied. Pass on_nonfinite='skip' to skip such "
                                 "steps, or lower the learning rate / add clip_gradients")
        if finite and self.scheduler is not None:
            self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, not finite, None

    def settle(self, state: TrainState, micro: int) -> None:
        """Read ``state``'s pending check (an earlier step's); raise if that step was not
        finite (its update was skipped on the device), after clearing the gradients this
        call accumulated. The error carries the state to continue from."""
        pending = state.pending_check
        if pending is not None and pending.failed():
            self.optimizer.zero_grad(set_to_none=True)
            stepped = " (the scheduler had stepped)" if self.scheduler is not None else ""
            raise NonFiniteError(
                _nonfinite(pending.step, pending.micro_step) + "its update was skipped on the "
                f"device, parameters and optimizer state are as before it{stepped}; seen at "
                f"micro-step {micro}. Pass on_nonfinite='skip' to skip such steps, or lower "
                "the learning rate / add clip_gradients; exc.state continues without it",
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

    @contextlib.contextmanager
    def naming_failures(self, state: TrainState, micro: int) -> Iterator[None]:
        """A collective that timed out or lost a peer inside, raised as the
        :class:`~shardwise.errors.CollectiveError` naming the step, micro-step and phase."""
        try:
            yield
        except RuntimeError as exc:
            failure = collective_failure(exc, f"optimizer step {state.step + 1} (micro-step "
                                              f"{micro}), {self.phase}") if self.synced > 1 else None
            if failure is None:
                raise
            raise failure from exc

    def step(self, state: TrainState, batch: Any,
             on_nonfinite: OnNonFinite | None) -> tuple[TrainState, StepOutput]:
        if on_nonfinite is not None:
            check_on_nonfinite(on_nonfinite, "step()", allow_none=True)
        micro, batches = state.micro_step + 1, state.window_batches + 1
        epoch, batch_in_epoch, epoch_end = self.position(state)
        boundary = batches == self.window or (epoch_end and self.plan.close_at_epoch_end)
        if self.move:
            batch = to_device(batch, self.device)
        if self.copies > 1 and state.micro_step == 0:
            self.phase = "checking the first batch across a tensor-parallel group"
            with self.naming_failures(state, micro):
                same_batch(batch, self.copies, self.device)
        no_sync = None if boundary else self.engine.no_sync(self.model, state)
        self.phase = "forward and backward"
        with self.naming_failures(state, micro):
            if no_sync is None:
                loss, total, weighted, losses = self.backward(state, batch)
            else:
                with no_sync():
                    loss, total, weighted, losses = self.backward(state, batch)
            # read after this call's work is queued: the device has long finished that check
            if state.pending_check is not None:
                self.settle(state, micro)
            norm, skipped, pending = None, False, None
            if boundary:
                try:
                    norm, skipped, pending = self.update(
                        state, total, batches, losses, on_nonfinite or self.plan.on_nonfinite,
                        read_now=epoch_end)
                except NonFiniteError as exc:  # raised at the step: its window is gone
                    exc.state = TrainState(
                        step=state.step + 1, micro_step=micro, epoch=epoch,
                        batch_in_epoch=batch_in_epoch, skipped_steps=state.skipped_steps + 1,
                        synced=state.synced or no_sync is None)
                    raise
        next_state = TrainState(
            step=state.step + boundary, micro_step=micro, epoch=epoch,
            batch_in_epoch=batch_in_epoch, skipped_steps=state.skipped_steps + skipped,
            window_batches=0 if boundary else batches,
            window_items=None if boundary else total,
            window_weighted=None if boundary else weighted,
            window_losses=None if boundary else losses,
            synced=state.synced or no_sync is None, pending_check=pending)
        lr = self.optimizer.param_groups[0].get("lr")
        return next_state, StepOutput(loss=loss, grad_norm=norm, stepped=boundary and not skipped,
                                      lr=lr)
