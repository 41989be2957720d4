# Skipping a non-finite optimizer step on the device, and reading its flag one step later.
"""An optimizer step without a host sync.

A step must not apply a non-finite update, and must say which step saw it. Reading the
finiteness flag on the host before ``optimizer.step()`` stops the CPU until the device has
finished the backward, so on an accelerator the next step's kernels are not queued while
the device works. torch's fused Adam/AdamW/SGD kernels take the flag as a tensor
(``found_inf``, the way ``GradScaler`` drives them) and leave parameters and optimizer
state as they were when it is set, all on the device. So the step hands them the flag,
copies it to host memory without blocking, and the next ``step()`` reads it after queueing
its own forward and backward: by then the copy is long done.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from shardwise._params import is_dtensor
from shardwise.state import PendingCheck

__all__ = ["fused_kernel_choice", "use_fused_kernel", "skips_on_device", "ready_to_skip",
           "defer"]

#: torch optimizers whose fused kernel honours ``found_inf`` for parameters and state
_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _sparse(model: torch.nn.Module) -> bool:
    return any(getattr(m, "sparse", False) is True for m in model.modules()
               if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)))


def fused_kernel_choice(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                        sharded: bool = False) -> tuple[bool, str]:
    """Whether shardwise switches ``optimizer`` to torch's fused kernel, and what the step
    does with it, in words (for ``explain()``). Changes nothing. ``sharded``: the
    parameters are, or will be, FSDP2's DTensors.

    Switched: a torch Adam, AdamW, or SGD without momentum, for which no implementation was
    chosen (``foreach`` and ``fused`` unset). Their fused kernels compute the same update
    (measured: within 3e-8 of the default after 50 AdamW steps; momentum-free SGD
    identical). SGD with momentum is left alone: torch's fused SGD fails on a parameter
    whose buffer is missing while others have theirs (one first trained later).
    """
    name = type(optimizer).__name__
    if skips_on_device(optimizer):
        return False, f"{name} skips non-finite steps on the device (its fused kernel)"
    host = "the finiteness flag is read on the host at each optimizer step"
    if isinstance(optimizer, _FUSED) and type(optimizer) not in _FUSED:
        return False, (f"{name}, a subclass, is not switched: {host}; fused=True skips on "
                       "the device")
    if type(optimizer) not in _FUSED:
        return False, f"{name} has no fused kernel that skips on the device: {host}"
    groups = optimizer.param_groups
    chosen = [k for k in ("foreach", "fused") if any(g.get(k) is not None for g in groups)]
    supported = _get_fused_kernels_supported_devices()
    params = [p for g in groups for p in g["params"]]
    sgd = type(optimizer) is torch.optim.SGD
    blocker = (
        f"you chose {'/'.join(chosen)}=" if chosen else
        "SGD with momentum" if sgd and any(g["momentum"] != 0 for g in groups) else
        "differentiable=True" if any(g.get("differentiable") for g in groups) else
        "a Tensor learning rate" if any(isinstance(g.get("lr"), torch.Tensor) for g in groups)
        else "a sparse embedding" if _sparse(model) else
        "FSDP2's DTensor parameters, which torch's fused SGD does not take"
        if sgd and (sharded or any(is_dtensor(p) for p in params)) else
        "a parameter that is not a real floating-point tensor on a supported device"
        if not all(p.is_floating_point() and p.device.type in supported for p in params)
        else None)
    if blocker is not None:
        return False, f"{name} keeps its implementation ({blocker}): {host}; fused=True avoids it"
    return True, (f"{name} runs torch's fused kernel (no implementation was chosen), which "
                  "skips a non-finite step on the device: no host sync per step")


def use_fused_kernel(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> str:
    """Apply :func:`fused_kernel_choice` to ``optimizer`` in place; return its words."""
    switch, words = fused_kernel_choice(optimizer, model)
    if switch:
        for group in optimizer.param_groups:
            group["fused"] = True
        optimizer.defaults["fused"] = True
    return words


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` takes a ``found_inf`` tensor now: torch's Adam/AdamW/SGD
    with every group fused (a loaded state dict may have changed that), or another
    optimizer that declares it the way GradScaler reads it."""
    if type(optimizer) in _FUSED:
        return all(g.get("fused") for g in optimizer.param_groups)
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def ready_to_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a skipped fused step leaves the optimizer as if it had not run.

    Adam and AdamW create zeroed state that a skipped step leaves at zero. SGD's fused
    kernel with momentum (chosen by the user), on a step that creates its buffers, leaves
    them uninitialised when it skips (torch 2.13), so until every trained parameter has one
    the flag is read on the host; another optimizer is trusted once it holds state for
    every trained parameter.
    """
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return True
    state = optimizer.state
    trained = [(g, p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if type(optimizer) is torch.optim.SGD:
        return all(g["momentum"] == 0 or state.get(p, {}).get("momentum_buffer") is not None
                   for g, p in trained)
    return all(state.get(p) for _, p in trained)


def defer(flag: torch.Tensor, step: int, micro_step: int,
          items: torch.Tensor | None = None, reduce: bool = False) -> PendingCheck:
    """A :class:`PendingCheck` for ``flag``: on CUDA copied to pinned host memory without
    blocking, with the event that marks the copy done; elsewhere the flag itself (a CPU's
    is host memory already)."""
    if flag.device.type != "cuda":
        return PendingCheck(step, micro_step, flag, items=items, reduce=reduce)
    host = torch.empty((), dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    ready: Any = torch.cuda.Event()
    ready.record()
    return PendingCheck(step, micro_step, host, ready, items=items, reduce=reduce)
