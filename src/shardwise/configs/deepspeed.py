# DeepSpeed settings (ds_config.json, or Accelerate's deepspeed_config block) mapped onto native transforms.
"""ZeRO stages -> replicate / shard_optimizer / shard; offload; precision; accumulation.

A config is first *read* into settings (:class:`Said`: each value checked, with the key and
the file that said it), then *built* into transforms. An Accelerate YAML's
``deepspeed_config`` block and the JSON file it names are read apart and merged in between:
a setting both say must agree (:func:`merge`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from shardwise._config_source import Shape, Source, short
from shardwise.bundle import Bundle
from shardwise.deepspeed_engine.auto import AUTO, check_total
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

T = TypeVar("T")

#: keys DeepSpeed's engine reads that mean nothing here, with the shape each takes
ENGINE_ONLY: dict[str, Shape] = {"steps_per_print": "count", "wall_clock_breakdown": "bool",
               "zero_allow_untested_optimizer": "bool", "zero_force_ds_cpu_optimizer": "bool",
               "communication_data_type": "text", "prescale_gradients": "bool"}
TOP = {"zero_optimization", "fp16", "bf16", "gradient_accumulation_steps", "gradient_clipping",
       "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler",
       *ENGINE_ONLY}
_TUNING: dict[str, Shape] = {"allgather_partitions": "bool", "allgather_bucket_size": "size",
           "overlap_comm": "bool", "reduce_scatter": "bool", "reduce_bucket_size": "size",
           "contiguous_gradients": "bool", "round_robin_gradients": "bool",
           "sub_group_size": "size", "stage3_prefetch_bucket_size": "size",
           "stage3_param_persistence_threshold": "size", "stage3_max_live_parameters": "size",
           "stage3_max_reuse_distance": "size", "stage3_gather_16bit_weights_on_model_save": "bool",
           "stage3_gather_fp16_weights_on_model_save": "bool", "load_from_fp32_weights": "bool",
           "elastic_checkpoint": "bool", "ignore_unused_parameters": "bool",
           "memory_efficient_linear": "bool"}
#: (new name, old name) of a setting DeepSpeed renamed
_ALIASES = (("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),)
_OFFLOAD_TUNING: dict[str, dict[str, Shape]] = {
    "offload_optimizer": {"nvme_path": "text", "pin_memory": "bool", "buffer_count": "size",
                          "fast_init": "bool", "ratio": "size", "pipeline_read": "bool",
                          "pipeline_write": "bool"},
    "offload_param": {"nvme_path": "text", "pin_memory": "bool", "buffer_count": "size",
                      "buffer_size": "size", "max_in_cpu": "size"}}
_PRECISION_TUNING: dict[str, dict[str, Shape]] = {
    "fp16": {"auto_cast": "bool", "loss_scale": "size", "initial_scale_power": "size",
             "loss_scale_window": "size", "hysteresis": "size", "consecutive_hysteresis": "bool",
             "min_loss_scale": "size", "fp16_master_weights_and_grads": "bool"},
    "bf16": {"immediate_grad_update": "bool"}}
#: settings whose "auto" is left to the pipeline's default (the batch sizes are the loader's)
_AUTO_NOTICE = ("fp16", "bf16", "steps", "clipping")




@attrs.frozen
class Said:
    """One setting as a config says it: the key, what it means here (checked), the value as
    written and the file."""

    key: str
    value: Any
    written: Any
    origin: str

    def __str__(self) -> str:
        return f"{self.key}={short(self.written)}"


#: what a config says, by setting: stage, offload_optimizer, offload_param (devices), fp16,
#: bf16 (enabled), steps, clipping, total, micro (batch sizes)
Settings = dict[str, Said]


def said(src: Source, key: str, value: Any, read: Callable[[Source, str, Any], Any],
         auto: bool = True) -> Said | None:
    """``value`` of ``key`` checked by ``read(src, key, value)``, None when absent;
    ``"auto"`` kept as AUTO where DeepSpeed takes it."""
    if value is None:
        return None
    if auto and isinstance(value, str) and value == AUTO:
        return Said(key, AUTO, value, src.origin)
    return Said(key, read(src, key, value), value, src.origin)


def device(src: Source, key: str, value: Any) -> str:
    """An offload device: ``"none"`` or ``"cpu"`` (nvme is refused)."""
    if not (isinstance(value, str) and value.lower() in ("none", "cpu")):
        raise src.fail(key, value, "none or cpu (nvme offload is not supported)")
    return value.lower()


def stage(src: Source, key: str, value: Any) -> int:
    """A ZeRO stage, 0 to 3."""
    return src.integer(key, value, 0, 3)


def positive(src: Source, key: str, value: Any) -> int:
    """A count or a size: an integer >= 1."""
    return src.integer(key, value, 1)


def _tuning(src: Source, block: Mapping[str, Any], shapes: Mapping[str, Shape], where: str,
            why: str) -> None:
    """One notice for each key of ``shapes`` in ``block``, after checking its shape (or that
    it is ``"auto"``, which Transformers fills)."""
    for key in sorted(set(block) & set(shapes)):
        if not (isinstance(block[key], str) and block[key] == "auto"):
            src.check_shape(f"{where}{key}", block[key], shapes[key])
        src.notice(f"{where}{key}", why)


def _zero(src: Source, cfg: Mapping[str, Any]) -> list[Said | None]:
    """The ``zero_optimization`` block: stage and offload devices."""
    zero = src.mapping("zero_optimization", cfg.get("zero_optimization"))
    src.check_keys(zero, {"stage", "offload_optimizer", "offload_param", *_TUNING},
                   "zero_optimization")
    _tuning(src, zero, _TUNING, "zero_optimization.", "is DeepSpeed tuning with no FSDP2 "
            "counterpart")
    for new, old in _ALIASES:  # shapes checked above: both are booleans
        if new in zero and old in zero and src.boolean(new, zero[new]) != src.boolean(old, zero[old]):
            raise ConfigError.at(src.origin, f"zero_optimization.{new}={short(zero[new])} and "
                              f"zero_optimization.{old}={short(zero[old])} contradict each other "
                              "(the same setting under its new and old names); keep one")
    out = [said(src, "zero_optimization.stage", zero.get("stage"), stage, False)]
    for part, shapes in _OFFLOAD_TUNING.items():
        block = src.mapping(f"zero_optimization.{part}", zero.get(part))
        src.check_keys(block, {"device", *shapes}, f"zero_optimization.{part}")
        _tuning(src, block, shapes, f"zero_optimization.{part}.", "is DeepSpeed tuning with "
                "no FSDP2 counterpart")
        out.append(said(src, f"zero_optimization.{part}.device", block.get("device"),
                        device, False))
    return out


def _precisions(src: Source, cfg: Mapping[str, Any]) -> list[Said | None]:
    """``fp16`` and ``bf16`` blocks: whether each is enabled."""
    out = []
    for name, shapes in _PRECISION_TUNING.items():
        block = src.mapping(name, cfg.get(name), 'a mapping like {"enabled": true}')
        src.check_keys(block, {"enabled", *shapes}, name)
        _tuning(src, block, shapes, f"{name}.", "is DeepSpeed's loss scaling or precision "
                "tuning: mixed_precision() uses torch.amp (a GradScaler for fp16)")
        out.append(said(src, f"{name}.enabled", block.get("enabled"), Source.boolean))
    if all(s is not None and s.value is True for s in out):
        raise ConfigError.at(src.origin, "fp16.enabled and bf16.enabled are both true; "
                          "enable one")
    return out


def read_json(src: Source) -> Settings:
    """What a DeepSpeed JSON says, each value checked; keys for DeepSpeed's engine alone give
    one notice each."""
    cfg = src.data
    src.check_keys(cfg, TOP)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            src.mapping(key, cfg[key])
            src.notice(key, "is not applied: the optimizer and scheduler you pass are used")
    _tuning(src, cfg, ENGINE_ONLY, "", "has no meaning outside DeepSpeed's engine")
    stage_, offload_optimizer, offload_param = _zero(src, cfg)
    fp16, bf16 = _precisions(src, cfg)
    values = {"stage": stage_, "offload_optimizer": offload_optimizer,
              "offload_param": offload_param, "fp16": fp16, "bf16": bf16,
              "steps": said(src, "gradient_accumulation_steps",
                            cfg.get("gradient_accumulation_steps"), positive),
              "clipping": said(src, "gradient_clipping", cfg.get("gradient_clipping"),
                               Source.number),
              "total": said(src, "train_batch_size", cfg.get("train_batch_size"), positive),
              "micro": said(src, "train_micro_batch_size_per_gpu",
                            cfg.get("train_micro_batch_size_per_gpu"), positive)}
    return {name: s for name, s in values.items() if s is not None}


def merge(mine: Settings, theirs: Settings) -> Settings:
    """An Accelerate block's settings (``mine``) with those of the file it names: a setting
    the file leaves out or ``"auto"`` is the block's; one both say must agree."""
    for name, own in mine.items():
        other = theirs.get(name)
        if other is not None and other.value != AUTO and other.value != own.value:
            raise ConfigError.at(own.origin, f"{own} contradicts {other} in {other.origin}; "
                              f"set it in one place (or \"auto\" in {other.origin})")
    return {**theirs, **mine}


def _value(settings: Settings, name: str, default: Any) -> Any:
    found = settings.get(name)
    return default if found is None or found.value == AUTO else found.value


def _make(setting: Said, factory: Callable[..., T], *args: Any) -> T:
    """``factory(*args)``; a refused argument is named as the setting that gave it."""
    try:
        return factory(*args)
    except ArgumentError as exc:
        raise ConfigError.at(setting.origin, f"{setting} is not accepted: {exc}") from None


def _sharding(settings: Settings) -> list[Transform]:
    """The ZeRO stage's transforms, and offload (which needs stage 2 or 3)."""
    zero = _value(settings, "stage", 0)
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
    out += [mixed_precision(p) for p in ("fp16", "bf16") if _value(settings, p, False)]
    steps = _value(settings, "steps", 1)
    if steps > 1:
        out.append(_make(settings["steps"], accumulate_gradients, steps))
    if _value(settings, "clipping", 0.0) > 0:
        out.append(_make(settings["clipping"], clip_gradients, settings["clipping"].value))
    for name in _AUTO_NOTICE:
        if name in settings and settings[name].value == AUTO:
            src.notice(settings[name].key, "is 'auto': left to the pipeline's default",
                       origin=settings[name].origin)
    check = _batch_check(settings, steps, env)
    return out if check is None else [*out, check]


def deepspeed_transforms(src: Source, env: Env) -> list[Transform]:
    """Transforms for a DeepSpeed JSON config."""
    return build(src, read_json(src), env)


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
        if self.micro is not None and size is not None and size != self.micro:
            auto = ' or "auto"' if self.micro_key.startswith("train_") else ""
            raise ConfigError.at(self.origin, f"{self.micro_key}={self.micro} but the loader's "
                              f"batch_size is {size}; build the DataLoader with "
                              f"batch_size={self.micro}, or set {self.micro_key} to {size}{auto}")
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
    total, micro = _value(settings, "total", None), _value(settings, "micro", None)
    key = settings["micro"].key if "micro" in settings else "train_micro_batch_size_per_gpu"
    check_total(given[0].origin, total, micro, steps, env.world_size, key)
    return BatchCheck(given[0].origin, micro, total, steps, key)
