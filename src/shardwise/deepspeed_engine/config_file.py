# The DeepSpeed JSON that DeepSpeed's own engine runs, from a ds_config.json or an Accelerate DEEPSPEED YAML.
"""What ``engine="deepspeed"`` hands to :func:`shardwise.deepspeed`.

A DeepSpeed JSON is taken as it is (DeepSpeed checks its own keys; ``"auto"`` values are
resolved when the pipeline is called). An Accelerate YAML with ``distributed_type:
DEEPSPEED`` is first read like any config (so its keys are checked and a block that
contradicts the file it names is refused), then its ``deepspeed_config`` block is written
into DeepSpeed's keys over the file it names.
"""

from __future__ import annotations

import copy
from typing import Any

from shardwise._config_source import Source, load_source, named_source
from shardwise.errors import ConfigError

__all__ = ["engine_config"]

#: Accelerate's deepspeed_config keys -> the DeepSpeed JSON path they set
_BLOCK = {"zero_stage": ("zero_optimization", "stage"),
          "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
          "offload_param_device": ("zero_optimization", "offload_param", "device"),
          "gradient_accumulation_steps": ("gradient_accumulation_steps",),
          "gradient_clipping": ("gradient_clipping",)}


def _put(config: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        child = config.get(key)
        if not isinstance(child, dict):
            child = config[key] = {}
        config = child
    config[path[-1]] = value


def _from_yaml(src: Source) -> dict[str, Any]:
    block = src.mapping("deepspeed_config", src.data.get("deepspeed_config"))
    config: dict[str, Any] = {}
    named = block.get("deepspeed_config_file")
    if named is not None:  # relative to the YAML's folder, as the native reader reads it
        config = copy.deepcopy(dict(named_source(src, "deepspeed_config.deepspeed_config_file",
                                                 named).data))
    for key, target in _BLOCK.items():
        if block.get(key) is not None:
            _put(config, target, block[key])
    precision = src.data.get("mixed_precision")
    if isinstance(precision, str) and precision.lower() in ("fp16", "bf16"):
        for name in ("fp16", "bf16"):
            _put(config, (name, "enabled"), name == precision.lower())
    return config


def engine_config(source: Any, kind: str) -> dict[str, Any]:
    """The DeepSpeed JSON of ``source`` (already read, and checked, as a ``kind`` config).

    Raises:
        ConfigError: the source is not a DeepSpeed config.
    """
    src = load_source(source)
    if kind == "deepspeed":
        return copy.deepcopy(dict(src.data))
    if kind == "accelerate" and str(src.data.get("distributed_type", "")).upper() == "DEEPSPEED":
        return _from_yaml(src)
    raise ConfigError.at(src.origin, f"engine=\"deepspeed\" runs a DeepSpeed config (a "
                      "ds_config.json, or an Accelerate config with distributed_type: "
                      f"DEEPSPEED); this is a {kind} config")
