# from_config / from_ddp_args: Accelerate YAML, DeepSpeed JSON, Transformers FSDP and DDP settings.
"""Pipelines from the config files users already have.

Example:
    >>> pipe = sw.from_config("default_config.yaml")
    >>> print(pipe.explain())
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise.configs._read import Source, load_source
from shardwise.configs.accelerate import accelerate_transforms
from shardwise.configs.deepspeed import deepspeed_transforms
from shardwise.configs.fsdp import KEYS as FSDP_KEYS
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.env import Env, detect
from shardwise.errors import ConfigError
from shardwise.pipeline import Pipeline, pipeline
from shardwise.transforms.base import Transform
from shardwise.transforms.replicate import replicate

__all__ = ["from_config", "from_ddp_args"]


def _kind(src: Source) -> str:
    keys = set(src.data)
    if keys & {"distributed_type", "compute_environment"}:
        return "accelerate"
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
               "gradient_clipping"} or any(isinstance(src.data.get(p), dict)
                                           for p in ("fp16", "bf16")):
        return "deepspeed"
    if keys and all(k.removeprefix("fsdp_") in FSDP_KEYS for k in keys):
        return "fsdp"
    raise ConfigError(f"{src.origin}: cannot tell the format from its keys {sorted(keys)}; "
                      "accepted: an Accelerate config (distributed_type, ...), a DeepSpeed "
                      "config (zero_optimization, ...) or a Transformers fsdp_config")


def _explained(env: Env, transforms: list[Transform], src: Source, kind: str) -> Pipeline:
    pipe = pipeline(attrs.evolve(env, config_path=None), *transforms)  # not the config again
    reason = f"from {kind} config {src.origin}"
    steps = tuple(s if s.reason else type(s)(s.transform, reason) for s in pipe.steps)
    return Pipeline(env=env, steps=steps, on_nonfinite=pipe.on_nonfinite,
                    choose_distribution=pipe.choose_distribution, notes=tuple(src.notices))


def from_config(source: str | Path | Mapping[str, Any], *, env: Env | None = None) -> Pipeline:
    """A pipeline from an Accelerate YAML, a DeepSpeed JSON or a Transformers ``fsdp_config``.

    The format is recognised from the content. Unknown keys, wrong types and impossible or
    contradictory values raise :class:`~shardwise.errors.ConfigError` naming the file, the
    key, the value and what is accepted; keys with no meaning here give one notice each
    (logged, and listed by ``explain()``).

    Args:
        source: a path (YAML or JSON) or a mapping.
        env: the env; by default :func:`shardwise.detect` (``use_cpu: true`` forces the CPU).

    Example:
        >>> pipe = sw.from_config("ds_config.json")
    """
    src = load_source(source)
    kind = _kind(src)
    if env is None:
        env = detect(device="cpu") if src.data.get("use_cpu") is True else detect()
    if kind == "accelerate":
        transforms = accelerate_transforms(src, env)
    elif kind == "deepspeed":
        transforms = deepspeed_transforms(src, env)[0]
    else:
        transforms = fsdp_transforms(src, src.data)
    return _explained(env, transforms, src, kind)


_BACKENDS = ("nccl", "gloo", "mpi", "ccl", "xccl", "hccl")


def from_ddp_args(*, ddp_backend: str | None = None,
                  ddp_find_unused_parameters: bool | None = None,
                  ddp_bucket_cap_mb: float | None = None, ddp_timeout: float | None = None,
                  ddp_broadcast_buffers: bool | None = None, env: Env | None = None) -> Pipeline:
    """A ``replicate()`` pipeline from Transformers' ``TrainingArguments`` DDP settings.

    Example:
        >>> pipe = sw.from_ddp_args(ddp_bucket_cap_mb=50, ddp_timeout=7200)
    """
    overrides: dict[str, Any] = {}
    if ddp_backend is not None:
        if ddp_backend not in _BACKENDS:
            raise ConfigError(f"ddp_backend={ddp_backend!r} is not accepted; accepted: "
                              f"{', '.join(_BACKENDS)}")
        overrides["backend"] = ddp_backend
    if ddp_timeout is not None:
        overrides["timeout"] = datetime.timedelta(seconds=ddp_timeout)
    if env is None:
        env = detect(**overrides)
    elif overrides:
        env = attrs.evolve(env, **overrides)
    options: dict[str, Any] = {}
    if ddp_find_unused_parameters is not None:
        options["find_unused_parameters"] = ddp_find_unused_parameters
    if ddp_bucket_cap_mb is not None:
        options["bucket_mb"] = ddp_bucket_cap_mb
    if ddp_broadcast_buffers is not None:
        options["broadcast_buffers"] = ddp_broadcast_buffers
    return pipeline(env, replicate(**options))
