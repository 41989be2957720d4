# TrainingArguments' distribution fields (fsdp, deepspeed, ddp_*) mapped onto engines' transforms.
"""``fsdp``/``fsdp_config``, ``deepspeed`` (native mapping or DeepSpeed's engine) and the
``ddp_*`` fields -> the distribution transforms and env overrides."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise import precision
from shardwise._config_source import Source, load_source, short
from shardwise.configs import ddp_settings
from shardwise.configs.deepspeed import BatchCheck, Said, build, merge, read_json
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.configs.training_args_fields import plain_value
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.accumulation import accumulate_gradients
from shardwise.transforms.base import Transform
from shardwise.transforms.clipping import clip_gradients
from shardwise.transforms.precision_policy import MixedPrecision, mixed_precision
from shardwise.transforms.replication import replicate
from shardwise.transforms.sharding import Shard

__all__ = ["fsdp_block", "deepspeed_transforms", "deepspeed_engine_transforms", "ddp_overrides",
           "distribution_transforms", "per_device_batch", "load_file"]


def fsdp_block(src: Source, a: dict[str, Any]) -> dict[str, Any] | None:
    """The FSDP settings of ``fsdp`` + ``fsdp_config``, None without FSDP."""
    value = plain_value(a["fsdp"])
    options: list[str] = []
    if isinstance(value, str):
        options = value.split()
    elif isinstance(value, (list, tuple)):
        options = [str(plain_value(v)) for v in value]
    elif value not in (None, False, True):
        raise src.fail("fsdp", value, "true, or options like \"full_shard auto_wrap\"")
    if not (value is True or options):
        if a["fsdp_config"]:
            src.notice("fsdp_config", "is not applied: fsdp is not set")
        return None
    raw = a["fsdp_config"]
    block = dict(load_file(src, "fsdp_config", raw).data) if isinstance(raw, (str, Path)) else \
        src.mapping("fsdp_config", raw)
    block = {k.removeprefix("fsdp_"): v for k, v in block.items()}
    for key, filled in _FILLED.items():  # what TrainingArguments writes itself
        if key in block and type(block[key]) is type(filled) and block[key] == filled:
            del block[key]
    for option in options:
        if option not in _FSDP_OPTIONS:
            raise src.fail("fsdp", value, ", ".join(_FSDP_OPTIONS))
        if _FSDP_OPTIONS[option] is not None:
            key, setting = _FSDP_OPTIONS[option]  # type: ignore[misc]
            block.setdefault(key, setting)
    return block


def deepspeed_transforms(src: Source, a: dict[str, Any], env: Env) -> list[Transform]:
    """The DeepSpeed config, its ``"auto"`` values taken from the arguments; a value both
    give must agree (as the Trainer refuses mismatches)."""
    raw = a["deepspeed"]
    inner = load_file(src, "deepspeed", raw if isinstance(raw, (str, Path, Mapping)) else
                  src.mapping("deepspeed", raw))
    try:
        theirs = read_json(inner)
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"deepspeed: {exc}") from None
    src.notices += inner.notices

    def mine(key: str, value: Any) -> Said:
        return Said(key, value, value, src.origin)

    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    clip = src.number("max_grad_norm", a["max_grad_norm"])
    settings = {"steps": mine("gradient_accumulation_steps", steps),
                "clipping": mine("max_grad_norm", clip),
                "fp16": mine("fp16", src.boolean("fp16", a["fp16"])),
                "bf16": mine("bf16", src.boolean("bf16", a["bf16"])),
                "micro": mine("per_device_train_batch_size", src.integer(
                    "per_device_train_batch_size", a["per_device_train_batch_size"], 1))}
    out = build(src, merge(settings, theirs), env)
    if not any(isinstance(t, MixedPrecision) for t in out):
        out.append(mixed_precision(precision.TRAINER_DEFAULT))
    return out


def deepspeed_engine_transforms(src: Source, a: dict[str, Any]) -> list[Transform]:
    """DeepSpeed's own engine on the ``deepspeed`` config. As the Trainer does, a value the
    config gives must equal the argument's, and ``"auto"`` takes the argument's (clipping
    only where the config says ``"auto"``: DeepSpeed does not clip by default)."""
    from shardwise.deepspeed_engine.auto import AUTO
    from shardwise.deepspeed_engine.config_file import engine_config
    from shardwise.deepspeed_engine.transform import deepspeed

    raw = a["deepspeed"]
    try:
        config = engine_config(raw, "deepspeed")
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"deepspeed: {exc}") from None
    where = str(raw) if isinstance(raw, (str, Path)) else "the deepspeed mapping"
    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    clip = src.number("max_grad_norm", a["max_grad_norm"])
    bf16, fp16 = src.boolean("bf16", a["bf16"]), src.boolean("fp16", a["fp16"])
    per_device = src.integer("per_device_train_batch_size", a["per_device_train_batch_size"], 1)

    def said(*path: str) -> Any:
        value: Any = config
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    for path, argument, value in ((("gradient_accumulation_steps",), "gradient_accumulation_steps",
                                   steps),
                                  (("gradient_clipping",), "max_grad_norm", clip),
                                  (("train_micro_batch_size_per_gpu",),
                                   "per_device_train_batch_size", per_device),
                                  (("bf16", "enabled"), "bf16", bf16),
                                  (("fp16", "enabled"), "fp16", fp16)):
        given = said(*path)
        if given is not None and given != AUTO and given != value:
            raise ConfigError.at(src.origin, f"{argument}={short(value)} contradicts "
                              f"{'.'.join(path)}={short(given)} in {where}; set one (or "
                              "\"auto\" in the file)")
    if bf16 and fp16:
        raise ConfigError.at(src.origin, "bf16=True and fp16=True; choose one")
    out: list[Transform] = [
        deepspeed(config, source=where),
        mixed_precision("bf16" if bf16 else "fp16" if fp16 else precision.TRAINER_DEFAULT)]
    if steps > 1:
        out.append(accumulate_gradients(steps))
    if said("gradient_clipping") == AUTO and clip > 0:
        out.append(clip_gradients(clip))
    return [*out, per_device_batch(per_device, src.origin)]


def ddp_overrides(src: Source, a: dict[str, Any]) -> tuple[dict[str, Any], Transform]:
    overrides, replicated = ddp_settings(
        ddp_backend=a["ddp_backend"], ddp_find_unused_parameters=a["ddp_find_unused_parameters"],
        ddp_bucket_cap_mb=a["ddp_bucket_cap_mb"], ddp_timeout=a["ddp_timeout"],
        ddp_broadcast_buffers=a["ddp_broadcast_buffers"], origin=src.origin)
    if a["ddp_static_graph"] is not None:
        static = src.boolean("ddp_static_graph", a["ddp_static_graph"])
        replicated = attrs.evolve(replicated, static_graph=static)  # type: ignore[misc]
    return overrides, replicated


def distribution_transforms(src: Source, fsdp: dict[str, Any] | None, replicated: Transform,
                  each: bool) -> list[Transform]:
    if fsdp is None:
        if each:
            src.notice("accelerator_config.gradient_accumulation_kwargs.sync_each_batch",
                       "has no effect on results with DDP and is not applied")
        return [replicated]
    if replicated != replicate():
        src.notice("ddp_*", "are not applied: fsdp is set (DDP options have no meaning there)")
    out = fsdp_transforms(src, fsdp, "fsdp_config.")
    if each:
        out = [attrs.evolve(t, sync_each_batch=True) if isinstance(t, Shard) else t
               for t in out]
    return out


_FSDP_OPTIONS = {"full_shard": ("reshard_after_forward", True),
                 "shard_grad_op": ("reshard_after_forward", False),
                 "hybrid_shard": ("sharding_strategy", "HYBRID_SHARD"),
                 "hybrid_shard_zero2": ("sharding_strategy", "HYBRID_SHARD_ZERO2"),
                 "no_shard": ("sharding_strategy", "NO_SHARD"),
                 "offload": ("cpu_offload", True), "auto_wrap": None}

#: what TrainingArguments writes into fsdp_config itself: asks for nothing
_FILLED = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}


def load_file(src: Source, key: str, value: Any) -> Source:
    """The JSON or YAML file (or mapping) an argument gives, its refusal naming the argument."""
    try:
        return load_source(value)
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"{key}: {exc}") from None


def per_device_batch(size: int, origin: str = "TrainingArguments") -> BatchCheck:
    """``per_device_train_batch_size`` checked against the loader's ``batch_size`` when the
    pipeline is called: the Trainer would have used the argument."""
    return BatchCheck(origin, size, micro_key="per_device_train_batch_size")
