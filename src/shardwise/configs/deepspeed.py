# A DeepSpeed config's first output: native transforms (ZeRO stage -> replicate / shard_optimizer / shard).
"""ZeRO stages -> replicate / shard_optimizer / shard; offload; precision; accumulation.

The config is read by the one DeepSpeed reader (:mod:`shardwise.deepspeed_engine.settings`:
each value checked, with the key and the file that said it; an Accelerate block and the
file it names merged there); this module *builds* the settings into transforms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import attrs

from shardwise._config_source import Source
from shardwise.bundle import Bundle
from shardwise.deepspeed_engine.settings import AUTO, Said, Settings, check_micro, check_total, read, value
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConfigError
from shardwise.transforms.accumulation import accumulate_gradients
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.clipping import clip_gradients
from shardwise.transforms.offloading import offload
from shardwise.transforms.optimizer_sharding import shard_optimizer
from shardwise.transforms.precision_policy import mixed_precision
from shardwise.transforms.replication import replicate
from shardwise.transforms.sharding import shard

__all__ = ["BatchCheck", "build", "deepspeed_transforms"]

T = TypeVar("T")

#: settings whose "auto" is left to the pipeline's default (the batch sizes are the loader's)
_AUTO_NOTICE = ("fp16", "bf16", "steps", "clipping")


def _make(setting: Said, factory: Callable[..., T], *args: Any) -> T:
    """``factory(*args)``; a refused argument is named as the setting that gave it."""
    try:
        return factory(*args)
    except ArgumentError as exc:
        raise ConfigError.at(setting.origin, f"{setting} is not accepted: {exc}") from None


def _sharding(settings: Settings) -> list[Transform]:
    """The ZeRO stage's transforms, and offload (which needs stage 2 or 3)."""
    zero = value(settings, "stage", 0)
    out: list[Transform] = [[replicate()], [replicate(), shard_optimizer()],
                            [shard(reshard_after_forward=False)], [shard()]][zero]
    cpu = [s for s in map(settings.get, ("offload_optimizer", "offload_param"))
           if s is not None and s.value == "cpu"]
    if cpu:
        if zero < 2:
            given = settings.get("stage")
            now = f"{given} in {given.origin}" if given else "no stage is given (stage 0)"
            raise ConfigError(f"{cpu[0].origin}: {cpu[0]} needs ZeRO stage 2 or 3 (shard), but "
                              f"{now}; raise the stage, or drop the offload")
        out.append(offload())
    return out


def build(src: Source, settings: Settings, env: Env) -> list[Transform]:
    """The transforms of (merged) DeepSpeed settings; a notice for each ``"auto"`` left."""
    out = _sharding(settings)
    out += [mixed_precision(p) for p in ("fp16", "bf16") if value(settings, p, False)]
    steps = value(settings, "steps", 1)
    if steps > 1:
        out.append(_make(settings["steps"], accumulate_gradients, steps))
    if value(settings, "clipping", 0.0) > 0:
        out.append(_make(settings["clipping"], clip_gradients, settings["clipping"].value))
    for name in _AUTO_NOTICE:
        if name in settings and settings[name].value == AUTO:
            src.notice(settings[name].key, "is 'auto': left to the pipeline's default",
                       origin=settings[name].origin)
    check = _batch_check(settings, steps, env)
    return out if check is None else [*out, check]


def deepspeed_transforms(src: Source, env: Env) -> list[Transform]:
    """Transforms for a DeepSpeed JSON config."""
    return build(src, read(src), env)


@attrs.frozen(repr=False)
class BatchCheck(Transform):
    """A config's batch sizes against the bundle's loader, when the pipeline is called: the
    per-rank micro batch (DeepSpeed's ``train_micro_batch_size_per_gpu``, Transformers'
    ``per_device_train_batch_size``) must be the loader's ``batch_size`` (None: taken from
    it, DeepSpeed's ``"auto"``), and DeepSpeed's ``train_batch_size`` its product with the
    accumulation steps and world size."""

    origin: str = attrs.field(eq=False)
    micro: int | None
    total: int | None = None
    steps: int = 1
    micro_key: str = "train_micro_batch_size_per_gpu"
    stage: ClassVar[Stage] = Stage.DATA
    factory_name: ClassVar[str] = "batch_check"

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        size = getattr(bundle.loader, "batch_size", None)
        micro = self.micro if self.micro is not None else size
        check_micro(self.origin, self.micro_key, self.micro, size)
        check_total(self.origin, self.total, micro, self.steps, bundle.env.world_size,
                    "the micro batch")
        return bundle

    def describe(self, env: Env) -> str:
        micro = self.micro if self.micro is not None else "the loader's batch_size"
        total = (f", accumulation {self.steps}, total {self.total or 'auto'}"
                 if self.micro_key.startswith("train_") else "")
        return f"the loader's batch_size checked against {self.micro_key}: {micro}{total}"


def _batch_check(settings: Settings, steps: int, env: Env) -> BatchCheck | None:
    given = [s for s in (settings.get("total"), settings.get("micro")) if s is not None]
    if not given:
        return None
    total, micro = value(settings, "total", None), value(settings, "micro", None)
    key = settings["micro"].key if "micro" in settings else "train_micro_batch_size_per_gpu"
    check_total(given[0].origin, total, micro, steps, env.world_size, key)
    return BatchCheck(given[0].origin, micro, total, steps, key)
