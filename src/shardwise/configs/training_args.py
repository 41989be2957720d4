# Transformers' TrainingArguments (or a mapping of the same names) mapped onto transforms and sw.fit settings.
"""``TrainingArguments`` -> env overrides, transforms, ``sw.fit`` settings and notices.

Every field of ``TrainingArguments`` is in :data:`ARGUMENTS` with what it becomes here: a
transform, an env setting, a ``sw.fit`` setting, a notice (no meaning here) or a refusal.
Values a mapping leaves out take ``TrainingArguments``' defaults (:data:`DEFAULTS`), so a
mapping and the ``TrainingArguments`` built from it mean the same pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise._config_source import Source, say, short
from shardwise.configs.dynamo import compile_of
from shardwise.configs.parallelism import SIZES, asks_for_mesh, parallelism_transforms
from shardwise.configs.training_args_engines import (
    ddp_overrides,
    deepspeed_engine_transforms,
    deepspeed_transforms,
    distribution_transforms,
    fsdp_block,
    load_file,
    per_device_batch,
    trainer_precision,
    trainer_settings,
)
from shardwise.configs.training_args_fields import (
    ARGUMENTS,
    DEFAULTS,
    NOTICED,
    plain_value,
)
from shardwise.configs.training_args_loop import fit_settings
from shardwise.deepspeed_engine.settings import value
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.accumulation import accumulate_gradients
from shardwise.transforms.activation_checkpointing import CheckpointActivations, checkpoint_activations
from shardwise.transforms.base import Transform
from shardwise.transforms.clipping import clip_gradients
from shardwise.transforms.data_distribution import distribute_data
from shardwise.transforms.precision_policy import mixed_precision
from shardwise.transforms.replication import Replicate, replicate
from shardwise.transforms.sharding import Shard

__all__ = ["ARGUMENTS", "DEFAULTS", "TrainingSettings", "read_training_args", "for_fit",
           "for_trainer", "training_env_settings", "say", "per_device_batch"]


_ACCELERATOR_KEYS = {"split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                     "non_blocking", "gradient_accumulation_kwargs", "use_configured_state"}
@attrs.frozen


class TrainingSettings:
    """What a ``TrainingArguments`` means: transforms, ``sw.fit`` options, notices (not
    logged yet: :func:`say` logs what the caller keeps).

    Attributes:
        default_ddp: the transforms hold ``replicate()`` only because nothing else was asked
            (no ``fsdp``, ``deepspeed``, mesh or DDP option).
        notes: lines ``explain()`` lists after the notices, never logged (what ``sw.fit``
            will do with the loop settings).
    """

    transforms: tuple[Transform, ...]
    fit_options: dict[str, Any]
    notices: tuple[str, ...]
    origin: str
    default_ddp: bool = False
    notes: tuple[str, ...] = ()


def _fields(args: Any) -> tuple[dict[str, Any], str, bool]:
    """(the arguments by name, the origin, whether it is a TrainingArguments)."""
    if isinstance(args, Mapping):
        data = dict(args)
        unknown = sorted(k for k in data if k not in ARGUMENTS)
        if unknown:
            shown = ", ".join(short(k) for k in unknown[:5])
            raise ConfigError(f"training arguments: unknown argument(s) [{shown}]; accepted: "
                              "the fields of transformers.TrainingArguments (see "
                              "docs/training-args.md)")
        return {**DEFAULTS, **data}, "training arguments <mapping>", False
    base = next((c for c in type(args).__mro__ if c.__name__ == "TrainingArguments"), None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type) and base is not None:
        # a subclass's own fields (TRL's SFTConfig: max_length, packing, ...) are its
        # Trainer's: under that Trainer they are applied there, read here they are not
        data = {f.name: getattr(args, f.name) for f in dataclasses.fields(base)}
        return data, type(args).__name__, True
    raise ConfigError(f"from_training_args() takes a transformers.TrainingArguments or a mapping "
                      f"of its field names (got {type(args).__name__}: {short(args)})")


def _subclass_fields(args: Any) -> list[str]:
    """The fields a TrainingArguments subclass adds that are set (not their default)."""
    base = next(c for c in type(args).__mro__ if c.__name__ == "TrainingArguments")
    inherited = {f.name for f in dataclasses.fields(base)}
    defaults = _defaults_of(args)
    return sorted(f.name for f in dataclasses.fields(args) if f.name not in inherited
                  and _is_set(getattr(args, f.name), defaults.get(f.name)))


def _defaults_of(args: Any) -> dict[str, Any]:
    """Each field's default, for the fields a notice is given for when set."""
    out = {}
    for field in dataclasses.fields(args):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out


def _is_set(value: Any, default: Any) -> bool:
    """Whether a value asks for something (not its default, not empty)."""
    value = plain_value(value)
    if value is None or value is False or (isinstance(value, (str, list, tuple, dict))
                                           and not value):
        return False
    return not (type(value) is type(default) and value == default)


def _accelerator(src: Source, value: Any) -> dict[str, Any]:
    """``accelerator_config`` as a checked dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, (str, Path)):
        value = load_file(src, "accelerator_config", value).data
    cfg = src.mapping("accelerator_config", value)
    src.check_keys(cfg, _ACCELERATOR_KEYS, "accelerator_config")
    for key, refused in (("split_batches", True), ("dispatch_batches", True),
                         ("even_batches", False)):
        if cfg.get(key) is not None and src.boolean(f"accelerator_config.{key}", cfg[key]) \
                is refused:
            why = {"split_batches": "each rank takes the loader's batch_size (build the loader "
                                    "with the per-device batch size)",
                   "dispatch_batches": "every rank reads its own share of the data",
                   "even_batches": "the sampler pads every rank to the same number of batches "
                                   "(sw.gather_for_metrics drops the padding)"}[key]
            raise src.fail(f"accelerator_config.{key}", cfg[key], f"{not refused}: {why}")
    for key, why in (("use_seedable_sampler", "false: the sampler is always seeded "
                                              "(distribute_data(seed=...))"),
                     ("use_configured_state", "true: the pipeline builds its own state")):
        if cfg.get(key) is not None and src.boolean(f"accelerator_config.{key}", cfg[key]) \
                is (key == "use_configured_state"):
            src.notice(f"accelerator_config.{key}", f"is not applied: {why}")
    return cfg


def _accumulation(src: Source, a: dict[str, Any], cfg: dict[str, Any]) -> tuple[
        int, bool, bool]:
    """(steps, sync_with_dataloader, sync_each_batch)."""
    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    kwargs = src.mapping("accelerator_config.gradient_accumulation_kwargs",
                         cfg.get("gradient_accumulation_kwargs"))
    where = "accelerator_config.gradient_accumulation_kwargs"
    src.check_keys(kwargs, {"num_steps", "sync_with_dataloader", "sync_each_batch",
                            "adjust_scheduler"}, where)
    if kwargs.get("num_steps") is not None:
        given = src.integer(f"{where}.num_steps", kwargs["num_steps"], 1)
        if given != steps:
            raise ConfigError.at(src.origin, f"{where}.num_steps={given} contradicts "
                              f"gradient_accumulation_steps={steps}; set one")
    if kwargs.get("adjust_scheduler") is not None and \
            not src.boolean(f"{where}.adjust_scheduler", kwargs["adjust_scheduler"]):
        src.notice(f"{where}.adjust_scheduler", "is not applied: the scheduler steps once "
                   "per optimizer step")
    sync = src.boolean(f"{where}.sync_with_dataloader", kwargs.get("sync_with_dataloader", True))
    each = src.boolean(f"{where}.sync_each_batch", kwargs.get("sync_each_batch", False))
    return steps, sync, each


def training_env_settings(args: Any) -> dict[str, Any]:
    """The :func:`~shardwise.detect` settings ``args`` give (``ddp_backend``, ``ddp_timeout``,
    ``use_cpu``): the caller makes the Env from them; the readers take it made.

    Raises:
        ConfigError: a value of the wrong type or range, naming the argument.
    """
    a, origin, _ = _fields(args)
    src = Source({}, origin)
    overrides, _ = ddp_overrides(src, a)
    if src.boolean("use_cpu", a["use_cpu"]):
        overrides["device"] = "cpu"
    return overrides


def read_training_args(args: Any, env: Env, engine: str = "native") -> TrainingSettings:
    """What a ``TrainingArguments`` (or a mapping of its field names) means for the model under
    ``env`` (made from :func:`training_env_settings`): distribution, precision, accumulation,
    clipping, compilation, data. What only ``sw.fit`` applies is added by :func:`for_fit`;
    a Trainer on shardwise, which runs its own loop, takes :func:`for_trainer` of this.

    Raises:
        ConfigError: an unknown name, a value of the wrong type or range, a setting with no
            counterpart that changes results, or a contradiction, naming the argument(s).
    """
    a, origin, _ = _fields(args)
    src = Source({}, origin)
    src.logs = False  # the caller logs what it keeps (say)
    mesh = _mesh_block(src, a.get("parallelism_config"))
    if not src.boolean("average_tokens_across_devices", a["average_tokens_across_devices"]):
        raise src.fail("average_tokens_across_devices", False, "true (the loss is averaged over "
                       "the items of all ranks)")
    _, replicated = ddp_overrides(src, a)
    accel = _accelerator(src, a["accelerator_config"])
    steps, sync, each = _accumulation(src, a, accel)
    said = trainer_settings(src, a)
    fsdp = fsdp_block(src, a)
    if engine == "deepspeed" and a["deepspeed"] is None:
        raise ConfigError.at(origin, "engine=\"deepspeed\" runs the DeepSpeed config of the "
                          "deepspeed argument, which is not set")
    default_ddp = False
    if a["deepspeed"] is not None:
        if fsdp is not None:
            raise ConfigError.at(origin, "fsdp and deepspeed are both set; choose one")
        if mesh and asks_for_mesh(src, mesh, "parallelism_config."):
            raise src.fail("parallelism_config", a["parallelism_config"], "None beside "
                           "deepspeed (its ZeRO stages are the data-parallel dimension)")
        out = (deepspeed_engine_transforms(src, a, said) if engine == "deepspeed"
               else deepspeed_transforms(src, a, env, said))
        if each or not sync:
            src.notice("accelerator_config.gradient_accumulation_kwargs", "is not applied "
                       "under deepspeed (its accumulation follows gradient_accumulation_steps)")
    else:
        out = distribution_transforms(src, fsdp, replicated, each)
        default_ddp = fsdp is None and not mesh and replicated == replicate()
        if mesh:
            out = parallelism_transforms(src, mesh, out, env, where="parallelism_config.")
        out.append(mixed_precision(trainer_precision(said)))
        if steps > 1:
            out.append(src.build("gradient_accumulation_steps", steps, accumulate_gradients,
                                 steps, sync_with_dataloader=sync))
        clip = value(said, "clipping", 0.0)
        if clip > 0:
            out.append(src.build("max_grad_norm", clip, clip_gradients, clip))
        out.append(per_device_batch(value(said, "micro", None), origin))
    out += _compiled(src, a)
    out.append(_data(src, a, accel))
    return TrainingSettings(tuple(out), {}, tuple(src.notices), origin, default_ddp)


def for_fit(settings: TrainingSettings, args: Any, env: Env) -> TrainingSettings:
    """``settings`` with what ``sw.fit`` applies of ``args``: its options (epochs, steps,
    logging, checkpoints), activation checkpointing, and a notice for each loop field with
    no meaning there (a subclass's own fields included).

    Raises:
        ConfigError: a loop setting ``sw.fit`` cannot take, naming the argument.
    """
    a, origin, instance = _fields(args)
    src = Source({}, origin)
    src.logs = False
    own = _subclass_fields(args) if instance else []
    if own:
        src.notice(f"{', '.join(own[:5])}{', ...' if own[5:] else ''}", f"are {origin}'s own "
                   f"fields, set beyond TrainingArguments': they are not applied here (its "
                   "Trainer applies them; see sw.on_shardwise)")
    defaults = _defaults_of(args) if instance else {}
    for name, why in NOTICED.items():
        if name in a and _is_set(a[name], defaults.get(name)):
            src.notice(name, why)
    out = list(settings.transforms)
    if _checkpointing(src, a) and not any(isinstance(t, CheckpointActivations) for t in out):
        policy = next((t.policy for t in out if isinstance(t, Shard)), None)
        out.append(checkpoint_activations(policy))
    fit, notes = fit_settings(src, a, env.world_size)
    return attrs.evolve(settings, transforms=tuple(out), fit_options=fit,
                        notices=(*src.notices, *settings.notices), notes=tuple(notes))


def for_trainer(settings: TrainingSettings) -> TrainingSettings:
    """``settings`` as a Trainer on shardwise takes them: it applies its loop fields itself
    (no notices for them, no ``sw.fit`` options, its own gradient checkpointing), and where
    nothing was asked of DDP the pipeline chooses by memory (DDP while the model fits a safe
    share of the device, else FSDP2) instead of a plain ``replicate()``."""
    if not settings.default_ddp:
        return settings
    return attrs.evolve(settings, transforms=tuple(
        t for t in settings.transforms if not isinstance(t, Replicate)))


def _compiled(src: Source, a: dict[str, Any]) -> list[Transform]:
    """``torch_compile`` (or a backend or mode, which imply it): the whole model compiled."""
    backend, mode = a.get("torch_compile_backend"), a.get("torch_compile_mode")
    if not (src.boolean("torch_compile", a.get("torch_compile", False)) or backend or mode):
        return []
    return [compile_of(src, backend or "inductor", mode, where="torch_compile_")]


def _mesh_block(src: Source, value: Any) -> dict[str, Any]:
    """TrainingArguments' ``parallelism_config``: an Accelerate ``ParallelismConfig`` (its
    fields read) or a dict of its field names; empty when None."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    fields = [name for name in (*SIZES, "cp_backend", "sp_backend") if hasattr(value, name)]
    if not fields:
        raise src.fail("parallelism_config", value, "an accelerate ParallelismConfig, a dict "
                       "of its fields (dp_replicate_size, dp_shard_size, tp_size, cp_size), "
                       "or None")
    return {name: getattr(value, name) for name in fields}


def _checkpointing(src: Source, a: dict[str, Any]) -> bool:
    on = [src.boolean(k, a[k]) for k in ("activation_checkpointing", "gradient_checkpointing")
          if a.get(k) is not None]
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if a.get(key):
            src.notice(key, "is not applied: torch's non-reentrant checkpoint is used")
    return any(on)


def _data(src: Source, a: dict[str, Any], accel: dict[str, Any]) -> Transform:
    seed = a["data_seed"] if a["data_seed"] is not None else a["seed"]
    key = "data_seed" if a["data_seed"] is not None else "seed"
    # TrainingArguments turns pinning off for use_cpu itself
    pin = src.boolean("dataloader_pin_memory", a["dataloader_pin_memory"]) and \
        not src.boolean("use_cpu", a["use_cpu"])
    non_blocking = src.boolean("accelerator_config.non_blocking",
                               accel.get("non_blocking", False))
    return src.build(key, seed, distribute_data, seed=src.integer(key, seed, 0, 2**64 - 1),
                     pin_memory=None if pin else False, non_blocking=non_blocking)
