# The training step: forward, backward, sync, clip, optimizer and scheduler step, zero_grad.
"""The step behind ``Bundle.step``; everything that can be decided once is decided here."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardwise.data import DeviceLoader, to_device
from shardwise.errors import ConflictError, LossError, NonFiniteError, OptimizerError
from shardwise.state import StepOutput, TrainState
from shardwise.transforms.mixed_precision import autocast_factory

if TYPE_CHECKING:
    from shardwise.bundle import Bundle, OnNonFinite

__all__ = ["Stepper"]


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


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (its shard under FSDP2)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _copy_hyperparameters(source: torch.optim.Optimizer, engine: torch.optim.Optimizer) -> None:
    """Give the sharded engine the user's current hyperparameters (a scheduler changes them)."""
    for mine, theirs in zip(source.param_groups, engine.param_groups, strict=True):
        for key, value in mine.items():
            if key != "params":
                theirs[key] = value
    # the user's optimizer is the one an LR scheduler watches: it counts as stepped
    source._opt_called = True  # type: ignore[attr-defined]


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


class Stepper:
    """Runs ``Bundle.step``; built once per bundle, on the first step."""

    def __init__(self, bundle: Bundle) -> None:
        if bundle.optimizer is None:
            raise OptimizerError("step() needs an optimizer: pass one to the pipeline call")
        plan, env = bundle.plan, bundle.env
        self.model, self.optimizer = bundle.model, bundle.optimizer
        # the optimizer that steps: the user's, or the ZeRO-1 engine driven by its settings
        self.engine = bundle.sharded_optimizer or bundle.optimizer
        self.scheduler, self.scaler, self.loss_fn = bundle.scheduler, bundle.scaler, bundle.loss_fn
        self.plan = plan
        self.window = plan.accumulation_steps
        if plan.offload and not isinstance(self.model, FSDPModule) and env.is_distributed:
            raise ConflictError("offload() is carried out by shard(): add sw.shard() to the "
                                "pipeline, or remove offload()")
        self.autocast = autocast_factory(plan.precision, env.device) if plan.autocast else None
        self.ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        self.fsdp = self.model if isinstance(self.model, FSDPModule) else None
        self.static_graph = bool(self.ddp is not None and self.ddp.static_graph)
        self.synced_once = False  # DDP's static graph needs one synchronised iteration first
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.device = env.device
        # gradients arrive averaged over ranks when a wrapper synchronises them
        self.ranks = env.world_size if env.is_distributed and dist.is_initialized() else 1
        self.loader = bundle.loader if isinstance(bundle.loader, DeviceLoader) else None
        self.move = bundle.loader is None and env.device.type != "cpu"
        self.items: torch.Tensor | None = None  # items counted in this window (token-weighted)
        self.weighted: bool | None = None  # whether this window's losses are (sum, count)
        self.flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """The loss, and the item count when the loss is a sum."""
        if self.loss_fn is not None:
            result = self.loss_fn(self.model, batch)
            if isinstance(result, tuple):
                return _sum_and_count(result)
            return _loss_of(result), None
        if isinstance(batch, Mapping):
            out = self.model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = self.model(*batch)
        else:
            out = self.model(batch)
        return _loss_of(out), None

    def backward(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the loss to report."""
        if self.autocast is None:
            loss, items = self.forward(batch)
        else:
            with self.autocast():
                loss, items = self.forward(batch)
        weighted = items is not None
        if self.weighted is None:
            self.weighted = weighted
        elif self.weighted != weighted:
            raise LossError("loss_fn returned (loss_sum, num_items) for some micro-batches of a "
                            "window and a plain loss for others; return one form always")
        if weighted:
            count = torch.as_tensor(items, dtype=torch.float64, device=loss.device).reshape(())
            # a copy: the window's total is all-reduced in place, the user's tensor must not be
            self.items = count.clone() if self.items is None else self.items + count
            report = loss.detach() / count.to(loss.dtype)
        else:
            report = loss.detach()
            if self.window > 1:
                loss = loss / self.window
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        return report

    def normalise(self) -> None:
        """Divide summed gradients by the items of the whole window on all ranks."""
        total = self.items
        assert total is not None
        if self.ranks > 1:
            dist.all_reduce(total)
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        factor = (self.ranks / total).to(torch.float32)
        torch._foreach_mul_(grads, factor.to(grads[0].device) if grads else factor)

    def check_grads(self) -> tuple[torch.Tensor | None, bool]:
        """Clip when the plan says so; return (norm before clipping or None, all finite).

        Without clipping only finiteness is needed, and torch's fused check (the one
        GradScaler uses, with a scale of 1) gives it in one call. Reading the flag is the one
        host sync of an optimizer step. Replicated gradients are the same on every rank, and
        for sharded ones the check reduces the flag over the mesh, so all ranks agree.
        """
        plan = self.plan
        if plan.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, plan.max_grad_norm,
                                                  norm_type=plan.norm_type)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            return norm, math.isfinite(norm.item())
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None, True
        device = _local(grads[0]).device
        if device not in self.flags:
            self.flags[device] = (torch.zeros((), device=device), torch.ones((), device=device))
        found_inf, unit = self.flags[device]
        found_inf.zero_()
        # on sharded (DTensor) gradients torch reduces the flag over the mesh: all ranks agree
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, unit)
        return None, found_inf.item() == 0

    def update(self, state: TrainState,
               on_nonfinite: OnNonFinite) -> tuple[torch.Tensor | None, bool]:
        """Finish the window: normalise, unscale, clip, step. Returns (norm, skipped)."""
        optimizer, engine = self.optimizer, self.engine
        if engine is not optimizer:
            _copy_hyperparameters(optimizer, engine)
        if self.scaler is not None:
            self.scaler.unscale_(engine)
        if self.weighted:
            self.normalise()
        self.items, self.weighted = None, None
        norm, finite = self.check_grads()
        skipped = not finite
        if self.scaler is not None:
            self.scaler.step(engine)
            self.scaler.update()
        elif finite:
            engine.step()
        elif on_nonfinite == "raise":
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"non-finite gradients at optimizer step {state.step + 1} "
                f"(micro-step {state.micro_step + 1}); pass on_nonfinite='skip' to skip such "
                "steps, or lower the learning rate / add clip_gradients")
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def sync_context(self, state: TrainState, boundary: bool) -> Callable[[], Any] | None:
        """The context that skips gradient reduction on this micro-batch, or None."""
        if boundary or self.plan.sync_each_batch:
            return None
        if self.fsdp is not None:
            return functools.partial(_fsdp_no_sync, self.fsdp)
        if self.ddp is None:
            return None
        if self.static_graph and not self.synced_once:
            return None  # DDP's static graph must see one synchronised iteration first
        return self.ddp.no_sync

    def step(self, state: TrainState, batch: Any,
             on_nonfinite: OnNonFinite | None) -> tuple[TrainState, StepOutput]:
        micro = state.micro_step + 1
        boundary = micro % self.window == 0
        if self.move:
            batch = to_device(batch, self.device)
        if on_nonfinite is not None and on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"step() 'on_nonfinite' must be 'raise', 'skip' or None "
                             f"(got {on_nonfinite!r})")
        no_sync = self.sync_context(state, boundary)
        if no_sync is None:
            loss = self.backward(batch)
            self.synced_once = True
        else:
            with no_sync():
                loss = self.backward(batch)
        norm, skipped, steps = None, False, state.step
        if boundary:
            norm, skipped = self.update(state, on_nonfinite or self.plan.on_nonfinite)
            steps += 1
        loader = self.loader
        next_state = TrainState(
            step=steps, micro_step=micro,
            epoch=loader.epoch if loader is not None else state.epoch,
            batch_in_epoch=loader.batch_in_epoch if loader is not None else state.batch_in_epoch + 1,
            skipped_steps=state.skipped_steps + skipped)
        lr = self.optimizer.param_groups[0].get("lr")
        return next_state, StepOutput(loss=loss, grad_norm=norm, stepped=boundary and not skipped,
                                      lr=lr)
