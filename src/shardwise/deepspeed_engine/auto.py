# A DeepSpeed config made ready for DeepSpeed's engine: "auto" resolved, contradictions refused.
"""``"auto"`` values resolved as Transformers resolves them, from the pipeline and the objects.

What the pipeline said explicitly (a ``mixed_precision``, ``accumulate_gradients`` or
``clip_gradients`` transform) must agree with what the config says explicitly; ``"auto"``
(or a key left out) takes the pipeline's value. Anything still ``"auto"`` afterwards is an
error naming its key: DeepSpeed never sees an ``"auto"``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, cast

import attrs
import torch

from shardwise._text import short as _excerpt
from shardwise.errors import ConfigError
from shardwise.precision import Precision

__all__ = ["Given", "check_total", "resolve"]

AUTO = "auto"


@attrs.frozen
class Given:
    """What the pipeline says: each value with the transform that said it (None: a default)."""

    precision: str
    precision_by: str | None
    steps: int
    steps_by: str | None
    clipping: float | None
    clipping_by: str | None


def short(value: Any) -> str:
    """A short excerpt of ``repr(value)`` for messages."""
    return _excerpt(value, 60)


def check_total(origin: str, total: int | None, micro: int | None, steps: int, world: int,
                micro_name: str) -> None:
    """DeepSpeed's rule: train batch = micro batch x accumulation steps x world size."""
    if total is not None and micro is not None and total != micro * steps * world:
        raise ConfigError(
            f"{origin}: train_batch_size={total} must equal {micro_name} ({micro}) x "
            f"gradient_accumulation_steps ({steps}) x world size ({world}) = "
            f"{micro * steps * world}")


def _autos(value: Any, where: str = "") -> Iterator[str]:
    """The dotted keys still ``"auto"`` inside ``value``."""
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield from _autos(child, f"{where}{key}.")
    elif isinstance(value, str) and value == AUTO:
        yield where.rstrip(".")


MAX_COUNT = 2**31 - 1  # a batch size or step count beyond this is a typo


def _block(cfg: dict[str, Any], key: str, origin: str) -> dict[str, Any]:
    block = cfg.get(key)
    if block is None:
        block = cfg[key] = {}
    if not isinstance(block, dict):
        raise ConfigError.at(origin, f"{key}={short(block)}: accepted: a mapping")
    return block


class _Resolver:
    def __init__(self, cfg: dict[str, Any], origin: str) -> None:
        self.cfg, self.origin = cfg, origin

    def fail(self, text: str) -> ConfigError:
        return ConfigError.at(self.origin, f"{text}")

    def agree(self, key: str, said: Any, given: Any, by: str | None) -> Any:
        """The config's explicit value, or ``given`` where it says ``"auto"`` or nothing; an
        explicit value that differs from what a transform said is refused naming both."""
        if said is None or said == AUTO:
            return given
        if by is not None and said != given:
            raise self.fail(f"{key}={short(said)} contradicts {by} in the pipeline; set it in "
                            "one place (or \"auto\" in the config)")
        return said

    def count(self, key: str, value: Any) -> int:
        """An integer from 1 to :data:`MAX_COUNT` (a bool or a string is refused)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise self.fail(f"{key}={short(value)}: accepted: an integer from 1 to {MAX_COUNT}")
        return value

    def alias(self) -> None:
        """DeepSpeed's old name ``bfloat16`` read as ``bf16`` (it reads ``bfloat16`` only
        when ``bf16`` is absent); both given with different values are refused."""
        old = self.cfg.pop("bfloat16", None)
        if old is None:
            return
        if not isinstance(old, dict):
            raise self.fail(f"bfloat16={short(old)}: accepted: a mapping")
        new = self.cfg.get("bf16")
        if isinstance(new, dict) and "enabled" in new and "enabled" in old and \
                new["enabled"] != old["enabled"]:
            raise self.fail(f"bfloat16.enabled={short(old['enabled'])} and "
                            f"bf16.enabled={short(new['enabled'])} contradict each other (the same "
                            "setting under its old and new names); keep one")
        self.cfg["bf16"] = {**old, **(new if isinstance(new, dict) else {})}

    def precision(self, given: Given) -> str:
        self.alias()
        said: dict[str, Any] = {}
        for name in ("fp16", "bf16"):
            enabled = _block(self.cfg, name, self.origin).get("enabled")
            if enabled is not None and enabled != AUTO and not isinstance(enabled, bool):
                raise self.fail(f"{name}.enabled={short(enabled)}: accepted: true, false or "
                                "\"auto\"")
            said[name] = enabled
        on = [name for name, value in said.items() if value is True]
        if len(on) == 2:
            raise self.fail("fp16.enabled and bf16.enabled are both true; enable one")
        by = given.precision_by
        if on:
            precision = on[0]
            if by is not None and given.precision != precision:
                raise self.fail(f"{precision}.enabled=true contradicts {by} in the pipeline; set "
                                "it in one place (or \"auto\" in the config)")
        else:
            precision = given.precision
            if said.get(precision) is False:  # the config turns off what the pipeline asks
                if by is not None:
                    raise self.fail(f"{precision}.enabled=false contradicts {by} in the "
                                    "pipeline; set it in one place (or \"auto\" in the config)")
                precision = "fp32"
        for name in ("fp16", "bf16"):
            self.cfg[name]["enabled"] = precision == name
        return precision

    def batch(self, micro: int | None, steps: int, world: int) -> None:
        cfg = self.cfg
        said_micro = cfg.get("train_micro_batch_size_per_gpu")
        if said_micro in (None, AUTO):
            if micro is None:
                raise self.fail("train_micro_batch_size_per_gpu cannot be resolved: the loader "
                                "has no batch_size; write the value")
            cfg["train_micro_batch_size_per_gpu"] = micro
        elif self.count("train_micro_batch_size_per_gpu", said_micro) != micro and \
                micro is not None:
            raise self.fail(f"train_micro_batch_size_per_gpu={short(said_micro)} but the "
                            f"loader's batch_size is {micro}; make them equal or set it to "
                            "\"auto\"")
        total = cfg["train_micro_batch_size_per_gpu"] * steps * world
        said_total = cfg.get("train_batch_size")
        if said_total in (None, AUTO):
            cfg["train_batch_size"] = total
        else:
            check_total(self.origin, self.count("train_batch_size", said_total),
                        cfg["train_micro_batch_size_per_gpu"], steps, world,
                        "train_micro_batch_size_per_gpu")

    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        block = self.cfg.get("optimizer")
        if not isinstance(block, dict):
            return
        params = block.get("params")
        if not isinstance(params, dict) or optimizer is None:
            return
        group = optimizer.param_groups[0]
        fills = {"lr": group.get("lr"), "betas": list(group["betas"]) if "betas" in group else None,
                 "eps": group.get("eps"), "weight_decay": group.get("weight_decay")}
        for key, value in params.items():
            if value == AUTO and fills.get(key) is not None:
                params[key] = fills[key]

    def scheduler(self, optimizer: torch.optim.Optimizer | None) -> None:
        block = self.cfg.get("scheduler")
        params = block.get("params") if isinstance(block, dict) else None
        if not isinstance(params, dict):
            return
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        for key, value in {"warmup_max_lr": lr, "warmup_min_lr": 0.0}.items():
            if params.get(key) == AUTO and value is not None:
                params[key] = value

    def buckets(self, model: torch.nn.Module) -> None:
        zero = self.cfg.get("zero_optimization")
        if not isinstance(zero, dict):
            return
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        fills = {"reduce_bucket_size": lambda h: h * h,
                 "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                 "stage3_param_persistence_threshold": lambda h: 10 * h}
        for key, fill in fills.items():
            if zero.get(key) == AUTO:
                if not isinstance(hidden, int):
                    raise self.fail(f"zero_optimization.{key}=\"auto\" is filled from the "
                                    "model's config.hidden_size, which this model does not have;"
                                    " write the value")
                zero[key] = fill(hidden)


def resolve(config: Mapping[str, Any], origin: str, *, given: Given, micro: int | None,
            world: int, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Precision, int]:
    """``config`` ready for ``deepspeed.initialize``, its precision and accumulation steps.

    Raises:
        ConfigError: a contradiction with the pipeline, or a value left ``"auto"`` that
            cannot be resolved, naming the key.
    """
    cfg = copy.deepcopy(dict(config))
    r = _Resolver(cfg, origin)
    precision = r.precision(given)
    steps = r.agree("gradient_accumulation_steps", cfg.get("gradient_accumulation_steps"),
                    given.steps, given.steps_by)
    cfg["gradient_accumulation_steps"] = steps = r.count("gradient_accumulation_steps", steps)
    clip = r.agree("gradient_clipping", cfg.get("gradient_clipping"), given.clipping or 0.0,
                   given.clipping_by)
    if "gradient_clipping" in cfg or given.clipping_by is not None:
        cfg["gradient_clipping"] = clip
    r.batch(micro, steps, world)
    r.optimizer(optimizer)
    r.scheduler(optimizer)
    r.buckets(model)
    left = [_excerpt(key, 80).strip("'") for key in sorted(_autos(cfg))]
    if left:
        raise r.fail(f"{left[0]}=\"auto\" cannot be resolved here (shardwise fills the batch "
                     "sizes, accumulation, precision, clipping, optimizer and warm-up "
                     "learning rates and bucket sizes); write the value"
                     + (f" (also: {', '.join(left[1:4])})" if left[1:] else ""))
    return cfg, cast(Precision, precision), steps
