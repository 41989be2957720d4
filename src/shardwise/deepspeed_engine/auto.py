# The DeepSpeed config's second output: the JSON DeepSpeed's engine runs, "auto" resolved from the pipeline.
"""``"auto"`` values resolved as Transformers resolves them, from the pipeline and the objects.

The config is read by the one reader (:func:`shardwise.deepspeed_engine.settings.read`) and
joined with what the pipeline's transforms say explicitly (a ``mixed_precision``,
``accumulate_gradients`` or ``clip_gradients``) by the one rule,
:func:`~shardwise.deepspeed_engine.settings.merge`: ``"auto"`` (or a key left out) takes the
pipeline's value, two explicit values must agree. Anything still ``"auto"`` afterwards is
an error naming its key: DeepSpeed never sees an ``"auto"``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import attrs
import torch

from shardwise._config_source import Source
from shardwise._text import short as _excerpt
from shardwise.deepspeed_engine.settings import (
    AUTO,
    Said,
    Settings,
    check_micro,
    check_total,
    merge,
    read,
    value,
)
from shardwise.errors import ConfigError
from shardwise.precision import Precision

__all__ = ["Given", "resolve"]


@attrs.frozen
class Given:
    """What the pipeline says: each value with the transform that said it (None: a default)."""

    precision: str
    precision_by: str | None
    steps: int
    steps_by: str | None
    clipping: float | None
    clipping_by: str | None

    def settings(self) -> Settings:
        """What the pipeline's transforms say explicitly (defaults are not said)."""
        def by(name: str, transform: str | None, setting: Any) -> Settings:
            if transform is None:
                return {}
            return {name: Said(name, setting, setting, "the pipeline", shown=transform)}

        return {**by("fp16", self.precision_by, self.precision == "fp16"),
                **by("bf16", self.precision_by, self.precision == "bf16"),
                **by("steps", self.steps_by, self.steps),
                **by("clipping", self.clipping_by, self.clipping)}


def _autos(found: Any, where: str = "") -> Iterator[str]:
    """The dotted keys still ``"auto"`` inside ``found``."""
    if isinstance(found, Mapping):
        for key, child in found.items():
            yield from _autos(child, f"{where}{key}.")
    elif isinstance(found, str) and found == AUTO:
        yield where.rstrip(".")


def _precision(cfg: dict[str, Any], said: Settings, merged: Settings, given: Given) -> str:
    """The precision the config and the pipeline agree on, written into both flags (the
    old name ``bfloat16`` read into ``bf16``)."""
    on = [name for name in ("fp16", "bf16") if value(merged, name, False) is True]
    precision = on[0] if on else given.precision
    if not on and value(said, precision, None) is False:  # the config turns the default off
        precision = "fp32"
    old = cfg.pop("bfloat16", None)
    cfg["bf16"] = {**(old or {}), **(cfg.get("bf16") or {})}
    cfg["fp16"] = dict(cfg.get("fp16") or {})
    for name in ("fp16", "bf16"):
        cfg[name]["enabled"] = precision == name
    return precision


def _batch(cfg: dict[str, Any], origin: str, said: Settings, micro: int | None, steps: int,
           world: int) -> None:
    written = value(said, "micro", None)
    check_micro(origin, "train_micro_batch_size_per_gpu", written, micro)
    per_rank = written if written is not None else micro
    if per_rank is None:
        raise ConfigError.at(origin, "train_micro_batch_size_per_gpu cannot be resolved: the "
                             "loader has no batch_size; write the value")
    cfg["train_micro_batch_size_per_gpu"] = per_rank
    total = value(said, "total", None)
    check_total(origin, total, per_rank, steps, world, "train_micro_batch_size_per_gpu")
    cfg["train_batch_size"] = per_rank * steps * world


def _optimizer(cfg: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer block's ``"auto"`` hyperparameters from the optimizer passed."""
    block = cfg.get("optimizer")
    params = block.get("params") if isinstance(block, dict) else None
    if not isinstance(params, dict) or optimizer is None:
        return
    group = optimizer.param_groups[0]
    fills = {"lr": group.get("lr"), "betas": list(group["betas"]) if "betas" in group else None,
             "eps": group.get("eps"), "weight_decay": group.get("weight_decay")}
    for key, found in params.items():
        if found == AUTO and fills.get(key) is not None:
            params[key] = fills[key]


def _scheduler(cfg: dict[str, Any], optimizer: torch.optim.Optimizer | None,
               schedule: tuple[int | None, int | None]) -> None:
    """The scheduler block's ``"auto"`` warm-up learning rates, total and warm-up steps."""
    block = cfg.get("scheduler")
    params = block.get("params") if isinstance(block, dict) else None
    if not isinstance(params, dict):
        return
    lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
    total, warmup = schedule
    fills = {"warmup_max_lr": lr, "warmup_min_lr": 0.0, "total_num_steps": total,
             "warmup_num_steps": warmup}
    for key, fill in fills.items():
        if params.get(key) == AUTO and fill is not None:
            params[key] = fill


def _buckets(cfg: dict[str, Any], origin: str, model: torch.nn.Module) -> None:
    """ZeRO's ``"auto"`` bucket sizes from the model's hidden size, as Transformers fills
    them."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    fills = {"reduce_bucket_size": lambda h: h * h,
             "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, fill in fills.items():
        if zero.get(key) == AUTO:
            if not isinstance(hidden, int):
                raise ConfigError.at(origin, f"zero_optimization.{key}=\"auto\" is filled from "
                                     "the model's config.hidden_size, which this model does "
                                     "not have; write the value")
            zero[key] = fill(hidden)


def resolve(config: Mapping[str, Any], origin: str, *, given: Given, micro: int | None,
            world: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            schedule: Callable[[int], tuple[int | None, int | None]] = lambda steps: (None, None),
            ) -> tuple[dict[str, Any], Precision, int]:
    """``config`` ready for ``deepspeed.initialize``, its precision and accumulation steps.

    Raises:
        ConfigError: a value the reader refuses, a contradiction with the pipeline, or a
            value left ``"auto"`` that cannot be resolved, naming the key.
    """
    cfg = copy.deepcopy(dict(config))
    said = read(Source(cfg, origin), native=False)
    merged = merge(said, given.settings(), auto_in="the config")
    precision = _precision(cfg, said, merged, given)
    cfg["gradient_accumulation_steps"] = steps = value(merged, "steps", given.steps)
    if "gradient_clipping" in cfg or given.clipping_by is not None:
        cfg["gradient_clipping"] = value(merged, "clipping", given.clipping or 0.0)
    _batch(cfg, origin, said, micro, steps, world)
    _optimizer(cfg, optimizer)
    _scheduler(cfg, optimizer, schedule(steps))
    _buckets(cfg, origin, model)
    left = [_excerpt(key, 80).strip("'") for key in sorted(_autos(cfg))]
    run = [key for key in left if key.endswith(("total_num_steps", "warmup_num_steps"))]
    if run:
        raise ConfigError.at(origin, f"{run[0]}=\"auto\" is the run's length: give it as "
                             "sw.deepspeed(config, epochs=... or steps=..., warmup=...) (from "
                             "TrainingArguments: num_train_epochs or max_steps, warmup_steps), "
                             "or write the value")
    if left:
        raise ConfigError.at(origin, f"{left[0]}=\"auto\" cannot be resolved here (shardwise "
                             "fills the batch sizes, accumulation, precision, clipping, "
                             "optimizer and warm-up learning rates and bucket sizes); write "
                             "the value" + (f" (also: {', '.join(left[1:4])})" if left[1:] else ""))
    return cfg, cast(Precision, precision), steps
