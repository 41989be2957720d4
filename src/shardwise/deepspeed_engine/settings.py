# The one reader of a DeepSpeed config (ds_config.json, Accelerate's block): one AUTO, one rule.
"""What a DeepSpeed config says, read once, for both of its outputs.

A ``ds_config.json`` (or mapping), an Accelerate YAML's ``deepspeed_config`` block, and the
TrainingArguments fields the Trainer fills a config from are each *read* here into
:data:`Settings` (each value checked, with the key and the place that said it). Two
places that both say a setting are joined by :func:`merge`, the one contradiction rule:
``"auto"`` or nothing takes the other's value, two values must agree. The same rule joins a
config and the pipeline's transforms when DeepSpeed's engine runs it.

The two outputs read these settings: ``configs/deepspeed.py`` builds native transforms
(ZeRO stage -> replicate / shard_optimizer / shard, offload, precision, accumulation,
clipping), and ``deepspeed_engine/auto.py`` writes the JSON DeepSpeed's engine runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from shardwise._config_source import Shape, Source, named_source, short
from shardwise.errors import ConfigError

__all__ = ["AUTO", "BLOCK_KEYS", "Said", "Settings", "block_json", "check_micro", "check_total",
           "merge", "read", "read_block", "value"]

#: DeepSpeed's (and the Trainer's) "fill this in for me"; the only spelling of it in shardwise
AUTO = "auto"

#: keys DeepSpeed's engine reads that mean nothing to native transforms, with their shapes
ENGINE_ONLY: dict[str, Shape] = {
    "steps_per_print": "count", "wall_clock_breakdown": "bool",
    "zero_allow_untested_optimizer": "bool", "zero_force_ds_cpu_optimizer": "bool",
    "communication_data_type": "text", "prescale_gradients": "bool"}
TOP = {"zero_optimization", "fp16", "bf16", "bfloat16", "gradient_accumulation_steps",
       "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer",
       "scheduler", *ENGINE_ONLY}
TUNING: dict[str, Shape] = {
    "allgather_partitions": "bool", "allgather_bucket_size": "size", "overlap_comm": "bool",
    "reduce_scatter": "bool", "reduce_bucket_size": "size", "contiguous_gradients": "bool",
    "round_robin_gradients": "bool", "sub_group_size": "size",
    "stage3_prefetch_bucket_size": "size", "stage3_param_persistence_threshold": "size",
    "stage3_max_live_parameters": "size", "stage3_max_reuse_distance": "size",
    "stage3_gather_16bit_weights_on_model_save": "bool",
    "stage3_gather_fp16_weights_on_model_save": "bool", "load_from_fp32_weights": "bool",
    "elastic_checkpoint": "bool", "ignore_unused_parameters": "bool",
    "memory_efficient_linear": "bool"}
#: (new name, old name) of a zero_optimization setting DeepSpeed renamed
_ALIASES = (("stage3_gather_16bit_weights_on_model_save",
             "stage3_gather_fp16_weights_on_model_save"),)
OFFLOAD_TUNING: dict[str, dict[str, Shape]] = {
    "offload_optimizer": {"nvme_path": "text", "pin_memory": "bool", "buffer_count": "size",
                          "fast_init": "bool", "ratio": "size", "pipeline_read": "bool",
                          "pipeline_write": "bool"},
    "offload_param": {"nvme_path": "text", "pin_memory": "bool", "buffer_count": "size",
                      "buffer_size": "size", "max_in_cpu": "size"}}
PRECISION_TUNING: dict[str, dict[str, Shape]] = {
    "fp16": {"auto_cast": "bool", "loss_scale": "size", "initial_scale_power": "size",
             "loss_scale_window": "size", "hysteresis": "size", "consecutive_hysteresis": "bool",
             "min_loss_scale": "size", "fp16_master_weights_and_grads": "bool"},
    "bf16": {"immediate_grad_update": "bool"}}
#: a batch size or step count beyond this is a typo
MAX_COUNT = 2**31 - 1


@attrs.frozen
class Said:
    """One setting as one place says it: the key, what it means (checked), the value as
    written and the place (a file, ``TrainingArguments``, the pipeline).

    ``shown``, when given, is how the setting is named in messages (a transform's repr).
    """

    key: str
    value: Any
    written: Any
    origin: str
    shown: str | None = None

    def __str__(self) -> str:
        return self.shown or f"{self.key}={short(self.written)}"


#: what a place says, by setting: stage, offload_optimizer, offload_param (devices), fp16,
#: bf16 (enabled), steps, clipping, total, micro (batch sizes)
Settings = dict[str, Said]


def said(src: Source, key: str, value: Any, read_: Callable[[Source, str, Any], Any],
         auto: bool = True) -> Said | None:
    """``value`` of ``key`` checked by ``read_(src, key, value)``, None when absent;
    ``"auto"`` kept as AUTO where DeepSpeed takes it."""
    if value is None:
        return None
    if auto and isinstance(value, str) and value == AUTO:
        return Said(src.key(key), AUTO, value, src.origin)
    return Said(src.key(key), read_(src, key, value), value, src.origin)


def device(src: Source, key: str, value: Any) -> str:
    """An offload device for native transforms: ``"none"`` or ``"cpu"``."""
    if not (isinstance(value, str) and value.lower() in ("none", "cpu")):
        raise src.fail(key, value, "none or cpu (nvme offload is not supported)")
    return value.lower()


def engine_device(src: Source, key: str, value: Any) -> str:
    """An offload device for DeepSpeed's engine: ``"none"``, ``"cpu"`` or ``"nvme"``."""
    if not (isinstance(value, str) and value.lower() in ("none", "cpu", "nvme")):
        raise src.fail(key, value, "none, cpu or nvme")
    return value.lower()


def stage(src: Source, key: str, value: Any) -> int:
    """A ZeRO stage, 0 to 3."""
    return src.integer(key, value, 0, 3)


def positive(src: Source, key: str, value: Any) -> int:
    """A count or a size: an integer from 1 to :data:`MAX_COUNT`."""
    return src.integer(key, value, 1, MAX_COUNT)


def _tuning(src: Source, block: Mapping[str, Any], shapes: Mapping[str, Shape], where: str,
            why: str) -> None:
    """One notice for each key of ``shapes`` in ``block``, after checking its shape (or that
    it is ``"auto"``, which Transformers fills)."""
    for key in sorted(set(block) & set(shapes)):
        if not (isinstance(block[key], str) and block[key] == AUTO):
            src.check_shape(f"{where}{key}", block[key], shapes[key])
        src.notice(f"{where}{key}", why)


def _zero(src: Source, cfg: Mapping[str, Any], native: bool) -> list[Said | None]:
    """The ``zero_optimization`` block: stage and offload devices (and, for native
    transforms, every other key checked and noticed)."""
    zero = src.mapping("zero_optimization", cfg.get("zero_optimization"))
    tuning = "is DeepSpeed tuning with no FSDP2 counterpart"
    if native:
        src.check_keys(zero, {"stage", "offload_optimizer", "offload_param", *TUNING},
                       "zero_optimization")
        _tuning(src, zero, TUNING, "zero_optimization.", tuning)
        for new, old in _ALIASES:  # shapes checked above: both are booleans
            if new in zero and old in zero and \
                    src.boolean(new, zero[new]) != src.boolean(old, zero[old]):
                raise ConfigError.at(src.origin, f"zero_optimization.{new}={short(zero[new])} "
                                     f"and zero_optimization.{old}={short(zero[old])} contradict "
                                     "each other (the same setting under its new and old "
                                     "names); keep one")
    out = [said(src, "zero_optimization.stage", zero.get("stage"), stage, False)]
    for part, shapes in OFFLOAD_TUNING.items():
        block = src.mapping(f"zero_optimization.{part}", zero.get(part))
        if native:
            src.check_keys(block, {"device", *shapes}, f"zero_optimization.{part}")
            _tuning(src, block, shapes, f"zero_optimization.{part}.", tuning)
        out.append(said(src, f"zero_optimization.{part}.device", block.get("device"),
                        device if native else engine_device, False))
    return out


def _bfloat16(src: Source, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``bf16`` block, with DeepSpeed's old name ``bfloat16`` read into it (DeepSpeed
    reads ``bfloat16`` only when ``bf16`` is absent); the two disagreeing is refused."""
    new = src.mapping("bf16", cfg.get("bf16"), 'a mapping like {"enabled": true}')
    old = src.mapping("bfloat16", cfg.get("bfloat16"), 'a mapping like {"enabled": true}')
    if "enabled" in new and "enabled" in old and new["enabled"] != old["enabled"]:
        raise ConfigError.at(src.origin, f"bfloat16.enabled={short(old['enabled'])} and "
                             f"bf16.enabled={short(new['enabled'])} contradict each other (the "
                             "same setting under its old and new names); keep one")
    return {**old, **new}


def _precisions(src: Source, cfg: Mapping[str, Any], native: bool) -> list[Said | None]:
    """``fp16`` and ``bf16`` blocks: whether each is enabled (never both)."""
    out = []
    blocks = {"fp16": src.mapping("fp16", cfg.get("fp16"), 'a mapping like {"enabled": true}'),
              "bf16": _bfloat16(src, cfg)}
    for name, shapes in PRECISION_TUNING.items():
        if native:
            src.check_keys(blocks[name], {"enabled", *shapes}, name)
            _tuning(src, blocks[name], shapes, f"{name}.", "is DeepSpeed's loss scaling or "
                    "precision tuning: mixed_precision() uses torch.amp (a GradScaler for fp16)")
        out.append(said(src, f"{name}.enabled", blocks[name].get("enabled"), Source.boolean))
    if all(s is not None and s.value is True for s in out):
        raise ConfigError.at(src.origin, "fp16.enabled and bf16.enabled are both true; "
                             "enable one")
    return out


def read(src: Source, *, native: bool = True) -> Settings:
    """What a DeepSpeed JSON says, each value checked.

    ``native``: read for native transforms, so every key is checked, and keys for DeepSpeed's
    engine alone give one notice each; otherwise (DeepSpeed's engine runs the config, and
    checks its own keys) only the settings shardwise fills or checks are read.
    """
    cfg = src.data
    if native:
        src.check_keys(cfg, TOP)
        for key in ("optimizer", "scheduler"):
            if key in cfg:
                src.mapping(key, cfg[key])
                src.notice(key, "is not applied: the optimizer and scheduler you pass are used")
        _tuning(src, cfg, ENGINE_ONLY, "", "has no meaning outside DeepSpeed's engine")
    stage_, offload_optimizer, offload_param = _zero(src, cfg, native)
    fp16, bf16 = _precisions(src, cfg, native)
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


def merge(mine: Settings, theirs: Settings, *, auto_in: str | None = None) -> Settings:
    """The settings of two places that may both say one (an Accelerate block and the file it
    names, TrainingArguments and its ``deepspeed`` file, a config and the pipeline's
    transforms): a setting one leaves out or says ``"auto"`` is the other's; one both say
    must agree.

    Raises:
        ConfigError: at ``mine``'s place, naming both values and where ``"auto"`` may be
            written instead (``auto_in``, by default ``theirs``' place).
    """
    out = dict(theirs)
    for name, own in mine.items():
        other = theirs.get(name)
        if other is not None and AUTO not in (other.value, own.value) and other.value != own.value:
            raise ConfigError.at(own.origin, f"{own} contradicts {other} in {other.origin}; set "
                                 f"it in one place (or \"auto\" in {auto_in or other.origin})")
        if other is None or own.value != AUTO:
            out[name] = own
    return out


def value(settings: Settings, name: str, default: Any) -> Any:
    """A setting's value; ``default`` where it is absent or ``"auto"``."""
    found = settings.get(name)
    return default if found is None or found.value == AUTO else found.value


def check_total(origin: str, total: int | None, micro: int | None, steps: int, world: int,
                micro_name: str) -> None:
    """DeepSpeed's rule: train batch = micro batch x accumulation steps x world size."""
    if total is not None and micro is not None and total != micro * steps * world:
        raise ConfigError(
            f"{origin}: train_batch_size={total} must equal {micro_name} ({micro}) x "
            f"gradient_accumulation_steps ({steps}) x world size ({world}) = "
            f"{micro * steps * world}")


def check_micro(origin: str, key: str, micro: int | None, size: int | None) -> None:
    """A config's per-rank micro batch against the loader's ``batch_size``."""
    if micro is not None and size is not None and size != micro:
        auto = ' or "auto"' if key.startswith("train_") else ""
        raise ConfigError.at(origin, f"{key}={micro} but the loader's batch_size is {size}; "
                             f"build the DataLoader with batch_size={micro}, or set {key} to "
                             f"{size}{auto}")


# -- Accelerate's deepspeed_config block -----------------------------------------------------

#: the block's keys: (setting, how it is read, the DeepSpeed JSON path it sets)
_BLOCK: dict[str, tuple[str, Callable[[Source, str, Any], Any], tuple[str, ...]]] = {
    "zero_stage": ("stage", stage, ("zero_optimization", "stage")),
    "offload_optimizer_device": ("offload_optimizer", device,
                                 ("zero_optimization", "offload_optimizer", "device")),
    "offload_param_device": ("offload_param", device,
                             ("zero_optimization", "offload_param", "device")),
    "gradient_accumulation_steps": ("steps", positive, ("gradient_accumulation_steps",)),
    "gradient_clipping": ("clipping", Source.number, ("gradient_clipping",))}
#: keys of the block that only DeepSpeed's launcher or engine reads, with their shapes
_BLOCK_ONLY: dict[str, Shape] = {
    "zero3_init_flag": "bool", "zero3_save_16bit_model": "bool",
    "deepspeed_multinode_launcher": "text", "deepspeed_hostfile": "text",
    "deepspeed_inclusion_filter": "text", "deepspeed_exclusion_filter": "text",
    "deepspeed_moe_layer_cls_names": "text"}
_NVME_PATHS = ("offload_optimizer_nvme_path", "offload_param_nvme_path")
BLOCK_KEYS = {*_BLOCK, "deepspeed_config_file", *_NVME_PATHS, *_BLOCK_ONLY}


def _file(src: Source, block: Mapping[str, Any]) -> Source | None:
    """The DeepSpeed JSON the block names (relative to the YAML's folder), if any."""
    named = block.get("deepspeed_config_file")
    if named is None:
        return None
    return named_source(src, "deepspeed_config.deepspeed_config_file", named)


def read_block(src: Source, block: dict[str, Any], precision: str) -> Settings:
    """An Accelerate YAML's ``deepspeed_config`` block (and the YAML's ``mixed_precision``),
    merged with the file it names: settings both give must agree."""
    src.check_keys(block, BLOCK_KEYS, "deepspeed_config")
    for key, shape in _BLOCK_ONLY.items():
        if key in block:
            src.check_shape(f"deepspeed_config.{key}", block[key], shape)
            src.notice(f"deepspeed_config.{key}", "has no meaning outside DeepSpeed")
    for key in _NVME_PATHS:
        if block.get(key) not in (None, "none"):
            raise src.fail(f"deepspeed_config.{key}", block[key], "none (nvme offload is not "
                           "supported)")
    settings: Settings = {}
    for key, (name, read_, _) in _BLOCK.items():
        found = said(src, f"deepspeed_config.{key}", block.get(key), read_, auto=False)
        if found is not None:
            settings[name] = found
    if precision != "no":  # "no" is what Accelerate writes when the file decides precision
        for name in ("fp16", "bf16"):
            settings[name] = Said(src.key("mixed_precision"), name == precision, precision,
                                  src.origin)
    inner = _file(src, block)
    if inner is None:
        return settings
    try:
        theirs = read(inner)
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"deepspeed_config.deepspeed_config_file: {exc}") \
            from None
    src.notices += inner.notices
    return merge(settings, theirs)


def _put(config: dict[str, Any], path: tuple[str, ...], written: Any) -> None:
    for key in path[:-1]:
        child = config.get(key)
        if not isinstance(child, dict):
            child = config[key] = {}
        config = child
    config[path[-1]] = written


def block_json(src: Source) -> dict[str, Any]:
    """The DeepSpeed JSON an Accelerate ``distributed_type: DEEPSPEED`` YAML runs: the file
    its ``deepspeed_config`` block names, the block's settings written over it (the YAML
    was read, and its contradictions refused, by :func:`read_block`)."""
    block = src.mapping("deepspeed_config", src.data.get("deepspeed_config"))
    inner = _file(src, block)
    config = {} if inner is None else copy.deepcopy(dict(inner.data))
    for key, (_, _, path) in _BLOCK.items():
        if block.get(key) is not None:
            _put(config, path, block[key])
    precision = src.data.get("mixed_precision")
    if isinstance(precision, str) and precision.lower() in ("fp16", "bf16"):
        for name in ("fp16", "bf16"):
            _put(config, (name, "enabled"), name == precision.lower())
    return config
