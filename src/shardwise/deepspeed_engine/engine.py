# DeepSpeedEngine: the model and optimizer run by DeepSpeed's own engine (ZeRO 0-3, offload).
"""The ``deepspeed()`` engine, whose step hooks drive DeepSpeed's engine.

DeepSpeed decides the accumulation boundaries (its ``gradient_accumulation_steps``), scales
each loss by them in ``engine.backward``, clips, steps the optimizer and zeroes gradients in
``engine.step``. Its two step hooks tell it the pipeline's window boundaries, check the loss,
and step the user's LR scheduler once per optimizer step; the shared skeleton builds the
:class:`~shardwise.state.TrainState` from what they return, as for every engine.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from shardwise.engines.base import Engine, MemoryParts, state_bytes
from shardwise.engines.step_hooks import Backward, Micro, StepRun, WindowEnd, forward
from shardwise.env import Env
from shardwise.errors import CheckpointError, ConflictError, LossError, NonFiniteError
from shardwise.state import TrainState

__all__ = ["DeepSpeedEngine"]


@attrs.frozen(eq=False)
class DeepSpeedEngine(Engine):
    """DeepSpeed's engine over ``world_size`` ranks at ZeRO ``stage``.

    Attributes:
        stage: the ZeRO stage (0-3).
        world_size: the ranks it runs over.
        offload: what it offloads to the CPU ("optimizer", "parameters"), if anything.
        ds: the ``deepspeed.DeepSpeedEngine`` (None in an estimate: nothing is built).
    """

    stage: int
    world_size: int
    offload: tuple[str, ...] = ()
    ds: Any = None
    name: ClassVar[str] = "DeepSpeed"
    exports_in_place: ClassVar[bool] = False  # its partitions are DeepSpeed's own
    places_parameters: ClassVar[bool] = True
    owns_optimizer: ClassVar[bool] = True
    #: DeepSpeed's bf16/fp16 converts the module itself: the forward runs without autocast,
    #: as under DeepSpeed alone
    casts_parameters: ClassVar[bool] = True

    def gradient_ranks(self, env: Env) -> int:
        return self.world_size

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def full_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters as DeepSpeed's fp32 master weights, gathered (its
        ``safe_get_full_fp32_param``; the module's own value where it keeps none), and
        buffers as the module holds them."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap(model)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied ones too
        for name, value in module.state_dict().items():
            param = params.get(name)
            if param is None:
                yield name, value
                continue
            full = safe_get_full_fp32_param(param)
            if full is None:  # no ZeRO and no low-precision copy: the parameter is the master
                full = param.detach().float()
            yield name, full

    def backward(self, run: StepRun, state: TrainState, batch: Any, micro: Micro) -> Backward:
        """Forward, the loss checked, ``engine.backward``; before a window's last micro-batch
        also ``engine.step`` (DeepSpeed counts micro-batches there and updates nothing)."""
        if micro.on_nonfinite == "skip":
            raise ConflictError("step(on_nonfinite='skip') under deepspeed(): DeepSpeed "
                                "skips only fp16 overflows; use 'raise'")
        ds = self.ds
        # the pipeline's windows, as in the native engines: DeepSpeed is told each boundary
        ds.set_gradient_accumulation_boundary(micro.boundary)
        run.phase = "forward"
        # no autocast: DeepSpeed converts the module itself (casts_parameters)
        loss, items = forward(run, batch)
        if items is not None:
            raise LossError("under deepspeed() loss_fn returns a mean loss: DeepSpeed divides "
                            "each loss by its accumulation steps itself, so (loss_sum, "
                            "num_items) cannot be normalised over the window")
        if not ds.fp16_enabled():  # fp16: DeepSpeed's loss scaler skips the step itself
            _check_loss(loss, run, state, micro.index)
        run.phase = "backward"
        # DeepSpeed divides each loss by its accumulation steps; a window the epoch end
        # shortened is normalised by what it holds
        ds.backward(loss if micro.size == run.window else loss * (run.window / micro.size))
        if not micro.boundary:
            run.phase = "DeepSpeed step (no update)"
            ds.step()
        return Backward(loss.detach())

    def end_window(self, run: StepRun, state: TrainState, done: Backward, micro: Micro
                   ) -> WindowEnd:
        """``engine.step`` (DeepSpeed's clipping and optimizer step), then the user's
        scheduler unless DeepSpeed skipped the update (an fp16 overflow)."""
        ds = self.ds
        run.phase = "optimizer step"
        skipped_before = ds.skipped_steps
        ds.step()
        skipped = ds.skipped_steps != skipped_before
        value = ds.get_global_grad_norm()
        if not skipped and run.scheduler is not None:
            run.scheduler.step()
        return WindowEnd(None if value is None else torch.as_tensor(float(value)), skipped)

    own_checkpoint: ClassVar[str | None] = "deepspeed"

    def save_own(self, path: Path) -> None:
        self.ds.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)
        if dist.is_initialized():
            dist.barrier()  # rank 0 hashes every rank's files next

    def check_own(self, path: Path) -> None:
        """Every file DeepSpeed would unpickle, read first by the weights-only unpickler."""
        for file in sorted(path.rglob("*.pt")):
            check_pickle(file)

    def load_own(self, path: Path) -> None:
        loaded, _ = self.ds.load_checkpoint(str(path.parent), tag=path.name,
                                            load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {path}")

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        raise CheckpointError("a deepspeed() bundle saves in DeepSpeed's own format (sw.save / "
                              "sw.load); sw.export gathers its weights")

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        world = self.world_size

        def split(p: torch.Tensor) -> int:
            return math.ceil(p.numel() / world)

        params, _, opt = state_bytes(model, trained, optimizer_layout,
                                     numel=split if self.stage >= 3 else torch.numel,
                                     optimizer_ranks=world if 1 <= self.stage < 3 else 1)
        grads = sum((split(p) if self.stage >= 2 else p.numel()) * 4
                    for p in model.parameters() if id(p) in trained)
        if "optimizer" in self.offload:
            opt = 0
        if "parameters" in self.offload:
            params = 0
        return MemoryParts(params, grads, opt, 0, f"DeepSpeed ZeRO-{self.stage} over {world} "
                           "rank(s)")

    def describe(self, env: Env) -> str:
        off = f", offload of {' and '.join(self.offload)} to the CPU" if self.offload else ""
        return (f"DeepSpeed's engine, ZeRO stage {self.stage} over {self.world_size} rank(s)"
                f"{off}; its clipping and optimizer step, at the windows the pipeline sets")


#: the classes DeepSpeed's checkpoint files hold beside tensors and plain data: plain
#: records, rebuilt from their fields (no code of the file's choosing runs)
_SAFE = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
         "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
         "deepspeed.runtime.zero.config.ZeroStageEnum",
         "deepspeed.utils.tensor_fragment.fragment_address")


def check_pickle(path: Path) -> None:
    """Read ``path`` with torch's weights-only unpickler and DeepSpeed's plain records
    allowed, before DeepSpeed reads it with the full one.

    Raises:
        CheckpointError: the file names another class or function (it could run code).
    """
    allowed = []
    for name in _SAFE:
        module, _, attr = name.rpartition(".")
        found = getattr(importlib.import_module(module), attr, None)
        if found is not None:
            allowed.append(found)
    try:
        with torch.serialization.safe_globals(allowed):
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's refusals and damaged files alike
        text = str(exc)
        named = re.search(r"GLOBAL ([\w.]+)", text)
        why = f"it names {named.group(1)}, which could run code when read" if named else \
            f"it cannot be read ({type(exc).__name__})"
        raise CheckpointError(f"{path} is refused: {why}; only tensors, plain data and "
                              "DeepSpeed's own records are read") from None


def _check_loss(loss: torch.Tensor, run: StepRun, state: TrainState, micro: int) -> None:
    """Raise before backward when the loss is not finite on some rank (DeepSpeed would apply
    it under fp32/bf16; under fp16 its loss scaler skips the step instead)."""
    bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(())
    if run.synced > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise NonFiniteError(f"non-finite loss at optimizer step {state.step + 1} (micro-step "
                             f"{micro}) on some rank; nothing of this micro-batch was applied")
