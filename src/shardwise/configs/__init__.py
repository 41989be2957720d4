# read_config / ddp_settings: Accelerate YAML, DeepSpeed JSON, Transformers FSDP and DDP settings.
"""Config readers: each turns the config a user already has into transforms and notices.

Readers build no pipeline: :func:`shardwise.from_config` and :func:`shardwise.pipeline`
(for a config handed over by ``shardwise launch``) take their transforms.
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
from shardwise.transforms.base import Transform
from shardwise.transforms.replicate import replicate

__all__ = ["ConfigResult", "read_config", "ddp_settings"]


@attrs.frozen
class ConfigResult:
    """What a config file means here.

    Attributes:
        transforms: the transforms it asks for.
        notices: one line per key with no meaning here (also logged).
        origin: the file's path, or ``<mapping>``.
        kind: ``"accelerate"``, ``"deepspeed"`` or ``"fsdp"``.
        env: the env it runs under (``use_cpu: true`` puts it on the CPU).
    """

    transforms: tuple[Transform, ...]
    notices: tuple[str, ...]
    origin: str
    kind: str
    env: Env

    @property
    def reason(self) -> str:
        """How ``explain()`` names where these transforms came from."""
        return f"from {self.kind} config {self.origin}"


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


def read_config(source: str | Path | Mapping[str, Any], *, env: Env | None = None) -> ConfigResult:
    """The transforms and notices of an Accelerate YAML, a DeepSpeed JSON or a Transformers
    ``fsdp_config``, recognised from the content.

    Raises:
        ConfigError: unknown keys, wrong types, impossible or contradictory values, naming
            the file, the key, the value and what is accepted.
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
    return ConfigResult(tuple(transforms), tuple(src.notices), src.origin, kind, env)


_BACKENDS = ("nccl", "gloo", "mpi", "ccl", "xccl", "hccl")


def ddp_settings(*, ddp_backend: str | None = None,
                 ddp_find_unused_parameters: bool | None = None,
                 ddp_bucket_cap_mb: float | None = None, ddp_timeout: float | None = None,
                 ddp_broadcast_buffers: bool | None = None) -> tuple[dict[str, Any], Transform]:
    """Transformers' DDP arguments as (Env overrides, the ``replicate()`` they mean)."""
    overrides: dict[str, Any] = {}
    if ddp_backend is not None:
        if ddp_backend not in _BACKENDS:
            raise ConfigError(f"ddp_backend={ddp_backend!r} is not accepted; accepted: "
                              f"{', '.join(_BACKENDS)}")
        overrides["backend"] = ddp_backend
    if ddp_timeout is not None:
        overrides["timeout"] = datetime.timedelta(seconds=ddp_timeout)
    options: dict[str, Any] = {}
    if ddp_find_unused_parameters is not None:
        options["find_unused_parameters"] = ddp_find_unused_parameters
    if ddp_bucket_cap_mb is not None:
        options["bucket_mb"] = ddp_bucket_cap_mb
    if ddp_broadcast_buffers is not None:
        options["broadcast_buffers"] = ddp_broadcast_buffers
    return overrides, replicate(**options)
