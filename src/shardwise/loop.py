# sw.fit: the training loop, built only from the public pieces (step, save/load, reduce, predict).
"""A loop that gets the whole run right: resume, windows, logging, checkpoints, evaluation.

It is short on purpose: copy it and change what you need. Everything it does is public:
``bundle.step``, ``sw.load``/``sw.save``, ``sw.reduce``, ``sw.latest_checkpoint``.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.checkpoint.background import wait_for_saves
from shardwise.checkpoint.save_load import latest_checkpoint, load, save
from shardwise.errors import ArgumentError
from shardwise.loggers import Logger
from shardwise.metrics import reduce
from shardwise.state import TrainState
from shardwise.throughput import Meter
from shardwise.throughput import peak_flops as device_peak

__all__ = ["fit"]

log = logging.getLogger(__name__)


def _count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ArgumentError(f"fit() '{name}' must be an integer >= 1 or None (got {short(value)})")


def _check_kinds(bundle: Any, state: Any, checkpoint_dir: Any, eval_fn: Any, loggers: Any,
                 progress: Any) -> None:
    """Refuse, before the first step, what would only fail at a save, an evaluation or a log."""
    def refuse(name: str, value: Any, accepted: str) -> None:
        raise ArgumentError(f"fit() '{name}' must be {accepted} (got {type(value).__name__}: "
                            f"{short(value)})")

    if not isinstance(bundle, Bundle):
        refuse("bundle", bundle, "the Bundle a pipeline call returned")
    if state is not None and not isinstance(state, TrainState):
        refuse("state", state, "a TrainState or None")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        refuse("checkpoint_dir", checkpoint_dir, "a path (str or os.PathLike) or None")
    if eval_fn is not None and not callable(eval_fn):
        refuse("eval_fn", eval_fn, "a callable bundle -> {name: number} or None")
    if isinstance(loggers, (str, bytes)) or not isinstance(loggers, (list, tuple)):
        refuse("loggers", loggers, "an iterable of loggers (objects with log() and close())")
    for logger in loggers:
        if not (callable(getattr(logger, "log", None)) and callable(getattr(logger, "close", None))):
            refuse("loggers", logger, "loggers with log(metrics, step) and close()")
    if not isinstance(progress, bool):
        refuse("progress", progress, "True or False")


def _bar(bundle: Bundle, state: TrainState, steps: int | None, show: bool) -> Any:
    """A tqdm bar of optimizer steps on the main process, or None."""
    if not show or not bundle.env.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=state.step, unit="step", dynamic_ncols=True)


def _complete(state: TrainState, epochs: int | None, steps: int | None) -> bool:
    """Whether a (resumed) state is already at the end the call asks for."""
    return (steps is not None and state.step >= steps) or (
        epochs is not None and state.epoch >= epochs and not state.window_batches)


def fit(bundle: Bundle, *, epochs: int | None = None, steps: int | None = None,
        state: TrainState | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None, keep_last: int | None = None,
        eval_fn: Callable[[Bundle], Mapping[str, float]] | None = None,
        eval_every: int | None = None, log_every: int | None = 10,
        loggers: Iterable[Logger] = (), progress: bool = True,
        async_checkpoints: bool = False, report_to: Iterable[Logger] = (),
        peak_flops: float | None = None, config: Mapping[str, Any] | None = None
        ) -> TrainState:
    """Train ``bundle`` for ``epochs`` epochs of ``bundle.loader`` and/or ``steps`` optimizer
    steps (whichever ends first), and return the final state.

    With ``checkpoint_dir`` it resumes from the newest complete checkpoint there (unless
    ``state`` is given), saves every ``checkpoint_every`` optimizer steps and at the end,
    and on Ctrl-C saves the last completed optimizer step before re-raising. Every
    ``log_every`` optimizer steps the mean loss over those steps and all ranks (one
    reduction) goes to Python logging, the progress bar and ``loggers``; ``eval_fn(bundle)``
    returns metrics, run every ``eval_every`` steps and at the end. Every rank calls it.
    ``async_checkpoints=True`` writes the periodic checkpoints in the background
    (``sw.save(..., blocking=False)``: training goes on while the files are written); the
    last one, at the end or on Ctrl-C, is waited for before ``fit`` returns or re-raises.
    ``report_to`` are loggers too: the ones ``pipe.fit_options`` gives (TrainingArguments'
    ``report_to``), beside your own ``loggers``. A logger with ``init(config)`` (a tracker:
    :mod:`shardwise.trackers`) is started once before the first step with the run's
    configuration: its own ``config`` attribute (the TrainingArguments, for the trackers
    ``report_to`` built) updated with ``config``.

    Each logging step also logs the throughput since the last one, over all ranks and the
    time spent in training steps: ``train/samples_per_s``, ``train/tokens_per_s`` (when
    batches have ``input_ids``) and ``train/mfu`` (model FLOPs utilisation, a fraction: the
    model's training FLOPs per token from :func:`shardwise.throughput.flops_per_token` over
    the device's peak, from :data:`shardwise.throughput.PEAK_FLOPS` or ``peak_flops``, the
    peak FLOP/s of one device).

    On the main process each logged line is printed above the progress bar (with
    ``progress=False``, to Python logging only). A run whose checkpoint is already at its
    end says so, and at which step, and trains nothing.

    Example:
        >>> bundle = sw.pipeline(sw.detect())(model, optimizer, loader, eval_loader=val)
        >>> state = sw.fit(bundle, epochs=3, checkpoint_dir="ckpt", checkpoint_every=500)
    """
    if epochs is None and steps is None:
        raise ArgumentError("fit() needs 'epochs' or 'steps' (got neither)")
    for name, value in (("epochs", epochs), ("steps", steps), ("checkpoint_every",
                        checkpoint_every), ("eval_every", eval_every), ("log_every", log_every),
                        ("keep_last", keep_last)):
        _count(name, value)
    given = [list(g) if not isinstance(g, (str, bytes)) and hasattr(g, "__iter__") else g
             for g in (loggers, report_to)]
    for each in given:
        _check_kinds(bundle, state, checkpoint_dir, eval_fn, each, progress)
    loggers = [*given[0], *given[1]]
    _check_kinds(bundle, state, checkpoint_dir, eval_fn, loggers, progress)
    if not isinstance(async_checkpoints, bool):
        raise ArgumentError(f"fit() 'async_checkpoints' must be True or False (got "
                            f"{short(async_checkpoints)})")
    if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(
            peak_flops, (int, float)) or not peak_flops > 0 or peak_flops == float("inf")):
        raise ArgumentError(f"fit() 'peak_flops' must be a number > 0 (one device's peak FLOP/s) "
                            f"or None (got {short(peak_flops)})")
    if config is not None and not isinstance(config, Mapping):
        raise ArgumentError(f"fit() 'config' must be a mapping of the run's settings or None "
                            f"(got {type(config).__name__}: {short(config)})")
    if (checkpoint_every is not None or keep_last is not None) and checkpoint_dir is None:
        raise ArgumentError("fit() 'checkpoint_every' and 'keep_last' need a 'checkpoint_dir'")
    if eval_every is not None and eval_fn is None:
        raise ArgumentError(f"fit() 'eval_every'={short(eval_every)} needs an 'eval_fn' (a callable "
                            "bundle -> {name: number}) to run")
    if bundle.loader is None:
        raise ArgumentError("fit() needs a bundle with a loader: pass one to the pipeline call")
    if state is None:
        resumable = checkpoint_dir is not None and latest_checkpoint(checkpoint_dir) is not None
        state = load(checkpoint_dir, bundle) if resumable else bundle.init()  # type: ignore[arg-type]
    loggers = list(loggers) if bundle.env.is_main else []
    for logger in loggers:  # trackers start their run with its configuration
        start = getattr(logger, "init", None)
        if callable(start):  # what the logger was built with (report_to), then config=
            start({**(getattr(logger, "config", None) or {}), **(config or {})})
    bar = _bar(bundle, state, steps, progress)
    losses: list[torch.Tensor] = []
    boundary, saved, evaluated = state, -1, -1
    env = bundle.env
    meter = Meter(bundle.engine.unwrap(bundle.model), env, bundle.plan.copies,
                  peak_flops or device_peak(env, bundle.plan.precision))

    if _complete(state, epochs, steps):
        if bundle.env.is_main:
            log.warning("fit(): the run in %s is already complete at optimizer step %d (epoch %d"
                        " of %s, step limit %s): nothing to train; use another checkpoint_dir "
                        "for a new run", checkpoint_dir, state.step, state.epoch, epochs, steps)
        if bar is not None:
            bar.close()
        return state

    def record(metrics: Mapping[str, float]) -> None:
        line = f"step {boundary.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        # once, on the main rank: above the bar when there is one, else through logging
        if bar is not None:
            bar.write(line)
        elif env.is_main:
            log.info(line)
        for logger in loggers:
            logger.log(metrics, boundary.step)

    def checkpoint(background: bool = False) -> None:
        nonlocal saved
        if checkpoint_dir is not None and saved != boundary.step:
            with meter.paused():
                save(checkpoint_dir, bundle, boundary, keep_last=keep_last,
                     blocking=not background)
            saved = boundary.step

    def evaluate() -> None:
        nonlocal evaluated
        if eval_fn is not None and evaluated != boundary.step:
            with meter.paused():
                metrics = {f"eval/{k}": float(v) for k, v in eval_fn(bundle).items()}
            record(metrics)
            evaluated = boundary.step

    try:
        epochs_left = range(state.epoch, epochs) if epochs is not None else itertools.count()
        for _ in epochs_left:
            if steps is not None and boundary.step >= steps:
                break
            before = state.micro_step
            for batch in bundle.loader:
                state, out = bundle.step(state, batch)
                meter.add(out.samples, out.tokens)
                if log_every:
                    losses.append(out.loss)
                if state.window_batches:
                    continue  # inside a window: nothing is finished yet
                boundary = state
                if bar is not None:
                    bar.update(1)
                if log_every and state.step % log_every == 0:
                    loss = float(reduce(torch.stack(losses).float().mean()))
                    losses.clear()
                    rates = {f"train/{k}": v for k, v in meter.rates().items()}
                    record({"train/loss": loss, "train/lr": out.lr or 0.0, **rates})
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.4g}", lr=f"{out.lr or 0.0:.3g}")
                if checkpoint_every and state.step % checkpoint_every == 0:
                    checkpoint(background=async_checkpoints)
                if eval_every and state.step % eval_every == 0:
                    evaluate()
                if steps is not None and state.step >= steps:
                    break
            if state.micro_step == before:
                raise ArgumentError("fit(): bundle.loader yielded no batch in an epoch; check the "
                                    "dataset's length against the batch size and world size")
        boundary = bundle.check(boundary)
        bundle.engine.synchronise_replicas(bundle.model, bundle.optimizer)  # local SGD: one model
        evaluate()
        checkpoint()
        wait_for_saves()  # the last periodic save may be the final step's, still in flight
    except KeyboardInterrupt:
        log.warning("interrupted at step %d: saving the last completed step", boundary.step)
        checkpoint()
        wait_for_saves()
        raise
    finally:
        if bar is not None:
            bar.close()
        for logger in loggers:
            logger.close()
    return boundary
