# from_config / from_ddp_args: pipelines from the config files and arguments users already have.
"""Pipelines from configs: the readers in :mod:`shardwise.configs` say what a config means,
:func:`shardwise.pipeline.assemble` builds the pipeline.

Example:
    >>> pipe = sw.from_config("default_config.yaml")
    >>> print(pipe.explain())
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise.configs import ddp_settings, read_config
from shardwise.env import Env, detect
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.pipeline import Pipeline, assemble

__all__ = ["from_config", "from_ddp_args"]


def from_config(source: str | Path | Mapping[str, Any], *, env: Env | None = None) -> Pipeline:
    """A pipeline from an Accelerate YAML, a DeepSpeed JSON or a Transformers ``fsdp_config``.

    The format is recognised from the content. Every key maps to a transform, is refused, or
    gives one notice (a key with no meaning here: logged, and listed by ``explain()``).

    Args:
        source: a path (YAML or JSON) or a mapping.
        env: the env; by default :func:`shardwise.detect` (``use_cpu: true`` forces the CPU).

    Raises:
        ConfigError: unknown keys, wrong types or shapes, impossible or contradictory values
            (naming the file, the key, a short excerpt of the value and what is accepted),
            or transforms the env cannot run (``fp16`` on a CPU, ...), naming the file.

    Example:
        >>> pipe = sw.from_config("ds_config.json")
    """
    config = read_config(source, env=env)
    try:
        return assemble(config.env, [], config)
    except ShardwiseError as exc:  # what the config asks for, refused by this env
        if config.origin in str(exc):
            raise
        raise ConfigError(f"{config.origin}: {exc}") from exc


def from_ddp_args(*, ddp_backend: str | None = None,
                  ddp_find_unused_parameters: bool | None = None,
                  ddp_bucket_cap_mb: float | None = None, ddp_timeout: float | None = None,
                  ddp_broadcast_buffers: bool | None = None, env: Env | None = None) -> Pipeline:
    """A ``replicate()`` pipeline from Transformers' ``TrainingArguments`` DDP settings.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the argument.

    Example:
        >>> pipe = sw.from_ddp_args(ddp_bucket_cap_mb=50, ddp_timeout=7200)
    """
    overrides, replicated = ddp_settings(
        ddp_backend=ddp_backend, ddp_find_unused_parameters=ddp_find_unused_parameters,
        ddp_bucket_cap_mb=ddp_bucket_cap_mb, ddp_timeout=ddp_timeout,
        ddp_broadcast_buffers=ddp_broadcast_buffers)
    if env is None:
        env = detect(**overrides)
    elif overrides:
        env = attrs.evolve(env, **overrides)
    return assemble(env, [replicated], None)
