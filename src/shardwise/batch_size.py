# The batch size that fits: estimated before anything runs, or found by halving on out-of-memory.
"""Two ways to a batch size that fits, as an Accelerate script reaches for them.

- :func:`largest_batch_size` asks :func:`shardwise.estimate_memory` (a forward on the meta
  device, nothing allocated) for the largest batch whose estimate fits each rank's budget.
- :func:`find_executable_batch_size` runs your function and halves the batch size after an
  out-of-memory error, as Accelerate's decorator of that name does.
"""

from __future__ import annotations

import functools
import gc
import inspect
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from shardwise._text import short
from shardwise.env import Env
from shardwise.errors import ArgumentError, EnvError
from shardwise.memory import estimate_memory

__all__ = ["find_executable_batch_size", "largest_batch_size"]

T = TypeVar("T")

#: what torch and its allocators say when memory runs out
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "CUDNN_STATUS_NOT_SUPPORTED",
                  "CUBLAS_STATUS_ALLOC_FAILED")


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OUT_OF_MEMORY)


def _free() -> None:
    """What a failed try left: garbage, and the accelerator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _without_locals(exc: BaseException) -> BaseException:
    """``exc`` with the finished frames of its traceback (and its chain's) cleared: kept for
    its message and traceback, it no longer holds the failed try's tensors."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # skips frames still running (ours)
        error = error.__cause__ or error.__context__
    return exc


def find_executable_batch_size(function: Callable[..., T] | None = None, *,
                               starting_batch_size: int = 128) -> Any:
    """Call ``function(batch_size, *args, **kwargs)`` from ``starting_batch_size``, halving
    the batch size after each out-of-memory error until it runs (Accelerate's contract).

    Used as a decorator, with or without arguments; the decorated function is called without
    its first argument, which is supplied. Between tries the failed try's frames are
    released (its error is kept without their locals), garbage is collected and the
    accelerator's cache emptied; free what the failed try held elsewhere (an attribute, a
    global) in your own code. Any other error is raised at once. On several ranks each rank
    retries on its own: an out-of-memory error inside a collective leaves the other ranks
    waiting, so prefer :func:`largest_batch_size` (an estimate, nothing run) there.

    Raises:
        ArgumentError: ``starting_batch_size`` is not an integer >= 1, or the function's
            first parameter is not the batch size, or the caller passed it (by name, or
            by position: more positional arguments than follow it).
        RuntimeError: even a batch of 1 ran out of memory (the last error chained).

    Example:
        >>> @sw.find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size):
        ...     loader = DataLoader(dataset, batch_size=batch_size)
        ...     ...
        >>> train()
    """
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int) \
            or starting_batch_size < 1:
        raise ArgumentError(f"find_executable_batch_size() 'starting_batch_size' must be an "
                            f"integer >= 1 (got {short(starting_batch_size)})")
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size)
    parameters = list(inspect.signature(function).parameters.values())
    if not parameters:
        raise ArgumentError(f"find_executable_batch_size(): {function.__name__}() must take the "
                            "batch size as its first parameter")
    first = parameters[0].name
    # how many positional arguments may follow the batch size (None: any, *args)
    after = None if any(p.kind is p.VAR_POSITIONAL for p in parameters) else sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) - 1

    @functools.wraps(function)
    def tried(*args: Any, **kwargs: Any) -> T:
        if first in kwargs:
            raise ArgumentError(f"{function.__name__}() is called without {first!r}: "
                                "find_executable_batch_size supplies it")
        if after is not None and len(args) > after:  # Accelerate's check, by name here
            raise ArgumentError(
                f"{function.__name__}() is called without {first!r}: find_executable_batch_size "
                f"supplies it as the first argument (got {len(args)} positional argument(s), "
                f"{short(args[0])} first, where {function.__name__}() takes {after} after "
                f"{first!r}); remove it from the call")
        size, last = starting_batch_size, None
        while size >= 1:
            try:
                return function(size, *args, **kwargs)
            except Exception as exc:
                if not _out_of_memory(exc):
                    raise
                last = _without_locals(exc)
            _free()
            size //= 2
        raise RuntimeError(f"{function.__name__}(): no batch size from {starting_batch_size} "
                           "down to 1 ran without running out of memory") from last

    return tried


def largest_batch_size(model: nn.Module, pipeline: Any, make_batch: Callable[[int], Any], *,
                       start: int = 1024, env: Env | None = None,
                       optimizer: torch.optim.Optimizer | None = None) -> int:
    """The largest batch size up to ``start`` whose :func:`shardwise.estimate_memory` fits
    each rank's budget (``SAFE_FRACTION`` of its device memory).

    Args:
        model: the model (nothing is allocated for it).
        pipeline: the pipeline, or a list of transforms (as ``estimate_memory`` takes).
        make_batch: ``make_batch(n)`` returns a micro-batch of ``n`` samples (or tensors of
            its shapes).
        start: the largest batch size to consider.
        env: defaults to the pipeline's env.
        optimizer: the optimizer whose state layout to count.

    Raises:
        ArgumentError: ``start`` is not an integer >= 1.
        EnvError: the estimate cannot tell (the device's memory is unknown, or the forward
            cannot run on the meta device: the reason is given), or a batch of 1 does not fit.

    Example:
        >>> tokens = lambda n: {"input_ids": torch.zeros(n, 2048, dtype=torch.long)}
        >>> size = sw.largest_batch_size(model, pipe, tokens)
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise ArgumentError(f"largest_batch_size() 'start' must be an integer >= 1 (got "
                            f"{short(start)})")

    def fits(size: int) -> bool:
        estimate = estimate_memory(model, pipeline, env, batch=make_batch(size),
                                   optimizer=optimizer)
        if estimate.fits is None:
            why = estimate.activations_missing or "the device's memory is unknown"
            raise EnvError(f"largest_batch_size(): the estimate at batch size {size} cannot "
                           f"tell whether it fits: {why}")
        return estimate.fits

    high, size = start + 1, start  # high: the smallest size known not to fit (or beyond)
    while size >= 1 and not fits(size):  # halve until one fits...
        high, size = size, size // 2
    if size < 1:
        raise EnvError("largest_batch_size(): even a batch of 1 does not fit each rank's "
                       "budget under this pipeline; see sw.estimate_memory(...) for the terms")
    low = size
    while high - low > 1:  # ...then the largest between it and the one that did not
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


