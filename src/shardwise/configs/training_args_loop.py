# TrainingArguments' loop fields (steps, strategies, logging) mapped onto sw.fit settings.
"""``max_steps``, ``num_train_epochs``, ``save_*``, ``eval_*``, ``logging_*``, ``report_to``
-> the settings ``sw.fit`` takes (``pipe.fit_options``)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from shardwise._config_source import Source
from shardwise.configs.training_args_fields import plain_value

__all__ = ["fit_settings", "loggers_of", "fraction_or_count", "strategy"]


def fraction_or_count(src: Source, key: str, value: Any, max_steps: int) -> int:
    """A step interval: an integer >= 1, or a fraction < 1 of ``max_steps``."""
    if isinstance(value, float) and 0 < value < 1:
        if max_steps <= 0:
            raise src.fail(key, value, "an integer >= 1 (a fraction needs max_steps > 0)")
        return max(1, math.ceil(value * max_steps))
    return src.integer(key, value, 1)


def strategy(src: Source, key: str, value: Any, accepted: tuple[str, ...],
             per_epoch: str = "") -> str:
    """A ``*_strategy`` value (an enum's value, not its repr, in a refusal); ``per_epoch``
    says which step interval gives once per epoch."""
    text = plain_value(value)
    if not isinstance(text, str) or text.lower() not in accepted:
        why = " (sw.fit counts optimizer steps" + (f"; once per epoch is {per_epoch}" if
                                                    per_epoch and text == "epoch" else "") + ")" \
            if text in ("epoch", "best") else ""
        raise src.fail(key, text, ", ".join(accepted) + why)
    return text.lower()


def _per_epoch(a: dict[str, Any], key: str, world: int) -> str:
    """The ``*_steps`` of one action per epoch, as a formula of this run's values."""
    return (f"{key}=ceil(dataset size / ({a['per_device_train_batch_size']} per device x "
            f"{world} rank(s) x {a['gradient_accumulation_steps']} accumulation steps)) with "
            f"the strategy \"steps\"")


def fit_settings(src: Source, a: dict[str, Any], world: int = 1
                 ) -> tuple[dict[str, Any], list[str]]:
    """The ``sw.fit`` options, and notes for explain() (``world``: the ranks, for the
    refusal of an epoch strategy)."""
    fit: dict[str, Any] = {}
    notes: list[str] = []
    max_steps = src.integer("max_steps", a["max_steps"], -1)
    if max_steps > 0:
        fit["steps"] = max_steps
    else:
        epochs = src.number("num_train_epochs", a["num_train_epochs"])
        if not float(epochs).is_integer() or epochs < 1:
            raise src.fail("num_train_epochs", a["num_train_epochs"], "a whole number of epochs "
                           ">= 1 (for part of an epoch, set max_steps)")
        fit["epochs"] = int(epochs)
    logging = strategy(src, "logging_strategy", a["logging_strategy"], ("steps", "no"),
                        _per_epoch(a, "logging_steps", world))
    fit["log_every"] = None if logging == "no" else fraction_or_count(
        src, "logging_steps", a["logging_steps"], max_steps)
    saving = strategy(src, "save_strategy", a["save_strategy"], ("steps", "no"),
                        _per_epoch(a, "save_steps", world))
    output = src.text("output_dir", "trainer_output" if a["output_dir"] is None
                      else str(a["output_dir"]))
    if saving == "steps":
        fit["checkpoint_dir"] = output
        fit["checkpoint_every"] = fraction_or_count(src, "save_steps", a["save_steps"],
                                                     max_steps)
        if a["save_total_limit"] is not None:
            fit["keep_last"] = src.integer("save_total_limit", a["save_total_limit"], 1)
        notes.append(f"output_dir: sw.fit resumes from the newest checkpoint in {output} "
                     "(the Trainer resumes only when asked)")
    elif a["save_total_limit"] is not None:
        src.notice("save_total_limit", "is not applied: save_strategy is no")
    evaluating = strategy(src, "eval_strategy", a["eval_strategy"], ("steps", "no"),
                        _per_epoch(a, "eval_steps", world))
    if evaluating == "steps":
        every = a["eval_steps"] if a["eval_steps"] is not None else a["logging_steps"]
        fit["eval_every"] = fraction_or_count(src, "eval_steps", every, max_steps)
    if a["resume_from_checkpoint"] is not None:
        src.check_shape("resume_from_checkpoint", str(a["resume_from_checkpoint"]), "text")
        src.notice("resume_from_checkpoint", f"is not applied: sw.fit resumes from the newest "
                   f"checkpoint in {output}; for another one, sw.load it and pass state=")
    fit["progress"] = not (a["disable_tqdm"] is not None
                           and src.boolean("disable_tqdm", a["disable_tqdm"]))
    reporting = loggers_of(src, a["report_to"], output)
    if reporting:  # beside any loggers= of the caller's: sw.fit(bundle, loggers=..., **options)
        fit["report_to"] = reporting
        # what each tracker records as the run's configuration, as the Trainer gives it (a
        # config= of the caller's to sw.fit is added to it)
        arguments = {k: v for k, v in a.items()
                     if isinstance(v, (bool, int, float, str)) or v is None}
        for logger in reporting:
            with contextlib.suppress(AttributeError):  # a logger that takes no attribute
                logger.config = arguments
    return fit, notes


def loggers_of(src: Source, value: Any, output: str) -> list[Any]:
    """``report_to``'s trackers, each built by name (:mod:`shardwise.trackers`); ``"all"``
    is every one whose package is installed, as the Trainer reads it."""
    from shardwise import trackers

    names = [value] if isinstance(value, str) else value
    if names is None:
        return []
    accepted = f"{', '.join(trackers.names())}, all, none, or a list of those"
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise src.fail("report_to", value, accepted)
    if "all" in names:
        names = [n for n in trackers.names() if _installed(n)]
    unknown = [n for n in names if n != "none" and n not in trackers.names()]
    if unknown:
        raise src.fail("report_to", value, accepted + " (register_tracker adds a name)")
    return [trackers.tracker(n, output) for n in names if n != "none"]


def _installed(name: str) -> bool:
    """Whether a built-in tracker's package (named as the tracker) is installed; a
    registered one counts as installed."""
    import importlib.util

    built_in = ("tensorboard", "wandb", "mlflow", "trackio")
    return name not in built_in or importlib.util.find_spec(name) is not None
