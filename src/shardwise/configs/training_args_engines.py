# TrainingArguments' distribution fields (fsdp, deepspeed, ddp_*) mapped onto engines' transforms.
"""``fsdp``/``fsdp_config``, ``deepspeed`` (native mapping or DeepSpeed's engine) and the
``ddp_*`` fields -> the distribution transforms and env overrides."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise import precision
from shardwise._config_source import Source, load_source
from shardwise.configs import ddp_settings
from shardwise.configs.deepspeed import BatchCheck, build
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.configs.training_args_fields import plain_value
from shardwise.deepspeed_engine.settings import AUTO, Said, Settings, merge, read, value
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.accumulation import accumulate_gradients
from shardwise.transforms.base import Transform
from shardwise.transforms.clipping import clip_gradients
from shardwise.transforms.precision_policy import MixedPrecision, mixed_precision
from shardwise.transforms.replication import replicate
from shardwise.transforms.sharding import Shard

__all__ = ["fsdp_block", "trainer_settings", "trainer_precision", "deepspeed_transforms",
           "deepspeed_engine_transforms", "ddp_overrides", "distribution_transforms",
           "per_device_batch", "load_file"]


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


def trainer_settings(src: Source, a: dict[str, Any]) -> Settings:
    """The fields the Trainer fills a DeepSpeed config from (precision, accumulation,
    clipping, the per-device batch), read once as the DeepSpeed reader's settings: every
    path (native, DeepSpeed's mapping, DeepSpeed's engine) takes them from here."""
    def mine(key: str, given: Any) -> Said:
        return Said(key, given, given, src.origin)

    bf16, fp16 = src.boolean("bf16", a["bf16"]), src.boolean("fp16", a["fp16"])
    if bf16 and fp16:
        raise ConfigError.at(src.origin, "bf16=True and fp16=True; choose one")
    return {"steps": mine("gradient_accumulation_steps", src.integer(
                "gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)),
            "clipping": mine("max_grad_norm", src.number("max_grad_norm", a["max_grad_norm"])),
            "fp16": mine("fp16", fp16), "bf16": mine("bf16", bf16),
            "micro": mine("per_device_train_batch_size", src.integer(
                "per_device_train_batch_size", a["per_device_train_batch_size"], 1))}


def trainer_precision(said: Settings) -> str:
    """The precision the Trainer's ``bf16``/``fp16`` ask for (its default without either)."""
    return "bf16" if value(said, "bf16", False) else "fp16" if value(said, "fp16", False) \
        else precision.TRAINER_DEFAULT


def _deepspeed_file(src: Source, a: dict[str, Any], said: Settings, *, native: bool
                    ) -> tuple[Source, Settings]:
    """The ``deepspeed`` file or mapping and what it says, read by the one DeepSpeed reader
    (the caller merges it with the Trainer's fields: a value both give must agree, as the
    Trainer refuses mismatches, and ``"auto"`` takes the argument's)."""
    raw = a["deepspeed"]
    inner = load_file(src, "deepspeed", raw if isinstance(raw, (str, Path, Mapping)) else
                      src.mapping("deepspeed", raw))
    try:
        theirs = read(inner, native=native)
    except ConfigError as exc:
        raise ConfigError.at(src.origin, f"deepspeed: {exc}") from None
    src.notices += inner.notices
    return inner, theirs


def deepspeed_transforms(src: Source, a: dict[str, Any], env: Env, said: Settings
                         ) -> list[Transform]:
    """The DeepSpeed config as native transforms, its ``"auto"`` values taken from the
    arguments."""
    _, theirs = _deepspeed_file(src, a, said, native=True)
    out = build(src, merge(said, theirs), env)
    if not any(isinstance(t, MixedPrecision) for t in out):
        out.append(mixed_precision(precision.TRAINER_DEFAULT))
    return out


def deepspeed_engine_transforms(src: Source, a: dict[str, Any], said: Settings
                                ) -> list[Transform]:
    """DeepSpeed's own engine on the ``deepspeed`` config, checked against the arguments as
    for native transforms; the pipeline's transforms fill its ``"auto"`` values when it runs
    (clipping only where the config says ``"auto"``: DeepSpeed does not clip by default)."""
    from shardwise.deepspeed_engine.transform import deepspeed

    inner, theirs = _deepspeed_file(src, a, said, native=False)
    merge(said, theirs)
    where = str(a["deepspeed"]) if isinstance(a["deepspeed"], (str, Path)) else \
        "the deepspeed mapping"
    max_steps = a.get("max_steps")
    steps = max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) \
        and max_steps > 0 else None
    epochs = a.get("num_train_epochs") if steps is None else None
    warmup = a.get("warmup_steps") or 0
    run = deepspeed(copy.deepcopy(dict(inner.data)), source=where, steps=steps,
                    epochs=epochs if isinstance(epochs, (int, float)) and epochs > 0 else None,
                    warmup=warmup)
    out: list[Transform] = [run, mixed_precision(trainer_precision(said))]
    steps, clip = value(said, "steps", 1), value(said, "clipping", 0.0)
    if steps > 1:
        out.append(accumulate_gradients(steps))
    if "clipping" in theirs and theirs["clipping"].value == AUTO and clip > 0:
        out.append(clip_gradients(clip))
    return [*out, per_device_batch(value(said, "micro", None), src.origin)]


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
