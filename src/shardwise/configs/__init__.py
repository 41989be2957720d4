# read_config / ddp_settings: Accelerate YAML, DeepSpeed JSON, Transformers FSDP/distributed/DDP settings.
"""Config readers: each turns the config a user already has into transforms and notices.

Readers build no pipeline: :func:`shardwise.from_config` and :func:`shardwise.pipeline`
(for a config handed over by ``shardwise launch``) take their transforms.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import attrs

from shardwise._config_source import Source, load_source, short
from shardwise.configs.accelerate import accelerate_transforms, uses_cpu
from shardwise.configs.deepspeed import deepspeed_transforms
from shardwise.configs.distributed_config import MARKERS, as_mapping, distributed_config_transforms
from shardwise.configs.fsdp import KEYS as FSDP_KEYS
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.env import Env
from shardwise.errors import ConfigError, EnvError
from shardwise.transforms.base import Transform
from shardwise.transforms.replication import replicate

__all__ = ["ConfigResult", "config_kind", "config_env_settings", "read_config", "ddp_settings"]


@attrs.frozen
class ConfigResult:
    """What a config file means here.

    Attributes:
        transforms: the transforms it asks for.
        notices: one line per key with no meaning here (also logged).
        origin: the file's path, or ``<mapping>``.
        kind: ``"accelerate"``, ``"deepspeed"``, ``"fsdp"`` or ``"distributed"`` (a
            Transformers ``DistributedConfig``).
        env: the env it runs under (``use_cpu: true`` puts it on the CPU).
        deepspeed: whether it is a DeepSpeed config (a JSON, or an Accelerate YAML with
            ``distributed_type: DEEPSPEED``), which ``engine="deepspeed"`` can run.
    """

    transforms: tuple[Transform, ...]
    notices: tuple[str, ...]
    origin: str
    kind: str
    env: Env
    #: the config is DeepSpeed's (a JSON, or an Accelerate YAML with distributed_type DEEPSPEED)
    deepspeed: bool = False

    @property
    def reason(self) -> str:
        """How ``explain()`` names where these transforms came from."""
        return f"from {self.kind} config {self.origin}"


def config_kind(src: Source) -> str:
    """``"accelerate"``, ``"deepspeed"``, ``"distributed"`` or ``"fsdp"``, from the keys."""
    keys = set(src.data)
    if keys & {"distributed_type", "compute_environment"}:
        return "accelerate"
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
               "gradient_clipping", "fp16", "bf16"}:
        return "deepspeed"
    if keys & MARKERS:
        return "distributed"
    if any(k.removeprefix("fsdp_") in FSDP_KEYS for k in keys):
        return "fsdp"
    shown = ", ".join(short(k) for k in sorted(keys)[:8]) + (", ..." if len(keys) > 8 else "")
    raise ConfigError.at(src.origin, f"cannot tell the format from its keys [{shown}]; "
                      "accepted: an Accelerate config (distributed_type, ...), a DeepSpeed "
                      "config (zero_optimization, ...), a Transformers fsdp_config or a "
                      "Transformers DistributedConfig (pp_size, fsdp_size, ...)")


def config_env_settings(source: str | os.PathLike[str] | Mapping[str, Any] | Any
                        ) -> dict[str, Any]:
    """The :func:`~shardwise.detect` settings a config gives (an Accelerate config's
    ``use_cpu: true`` puts the job on the CPU): the entry point makes the Env from them.

    Raises:
        ConfigError: the source cannot be read, or its ``use_cpu`` is not a boolean.
    """
    src = load_source(as_mapping(source))
    return {"device": "cpu"} if config_kind(src) == "accelerate" and uses_cpu(src) else {}


def read_config(source: str | os.PathLike[str] | Mapping[str, Any] | Any, *,
                env: Env) -> ConfigResult:
    """The transforms and notices of an Accelerate YAML, a DeepSpeed JSON, a Transformers
    ``fsdp_config`` or ``DistributedConfig`` (the object or its dict), recognised from the
    content.

    Every key maps to a transform, is refused, or gives one notice (a key with no meaning
    here); nothing is skipped in silence.

    Raises:
        ConfigError: unknown keys, wrong types or shapes, impossible or contradictory values,
            naming the file, the key (a dotted path), a short excerpt of the value and what
            is accepted.
    """
    src = load_source(as_mapping(source))
    kind = config_kind(src)
    if kind == "accelerate":
        transforms = accelerate_transforms(src, env)
    elif kind == "deepspeed":
        transforms = deepspeed_transforms(src, env)
    elif kind == "distributed":
        transforms = distributed_config_transforms(src, env)
    else:
        transforms = fsdp_transforms(src, src.data)
    deepspeed = kind == "deepspeed" or (kind == "accelerate" and str(
        src.data.get("distributed_type", "")).upper() == "DEEPSPEED")
    return ConfigResult(tuple(transforms), tuple(src.notices), src.origin, kind, env, deepspeed)


_BACKENDS = ("nccl", "gloo", "mpi", "ccl", "xccl", "hccl")
#: Transformers' name of each replicate() option
_DDP_NAMES = {"find_unused_parameters": "ddp_find_unused_parameters",
              "bucket_mb": "ddp_bucket_cap_mb", "broadcast_buffers": "ddp_broadcast_buffers"}


def _timeout(src: Source, value: Any) -> datetime.timedelta:
    """``ddp_timeout`` seconds as the Env takes them (Env decides the range; it is asked here
    so that a refusal names ddp_timeout)."""
    seconds = src.number("ddp_timeout", value)
    try:
        timeout = Env(timeout=seconds).timeout
    except EnvError as exc:
        raise ConfigError.at(src.origin, f"ddp_timeout={short(value)} is not accepted: {exc}") \
            from None
    if not timeout:  # under a microsecond, which timedelta rounds to 0
        raise src.fail("ddp_timeout", value, "at least a microsecond")
    return timeout


def ddp_settings(*, ddp_backend: str | None = None,
                 ddp_find_unused_parameters: bool | None = None,
                 ddp_bucket_cap_mb: float | None = None, ddp_timeout: float | None = None,
                 ddp_broadcast_buffers: bool | None = None, origin: str = "from_ddp_args()"
                 ) -> tuple[dict[str, Any], Transform]:
    """Transformers' DDP arguments as (Env overrides, the ``replicate()`` they mean).

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the argument and
            ``origin`` (where the arguments came from).
    """
    src = Source({}, origin)
    overrides: dict[str, Any] = {}
    if ddp_backend is not None:
        if not isinstance(ddp_backend, str) or ddp_backend not in _BACKENDS:
            raise src.fail("ddp_backend", ddp_backend, ", ".join(_BACKENDS))
        overrides["backend"] = ddp_backend
    if ddp_timeout is not None:
        overrides["timeout"] = _timeout(src, ddp_timeout)
    given: dict[str, Any] = {"find_unused_parameters": ddp_find_unused_parameters,
                             "bucket_mb": ddp_bucket_cap_mb,
                             "broadcast_buffers": ddp_broadcast_buffers}
    options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    for option, value in options.items():  # one at a time, so a refusal names its argument
        if option == "bucket_mb":
            src.number(_DDP_NAMES[option], value)
        elif not isinstance(value, bool):
            raise src.fail(_DDP_NAMES[option], value, "True or False")
        src.build(_DDP_NAMES[option], value, replicate, **{option: value})
    return overrides, replicate(**options)
