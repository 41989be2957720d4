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

from shardwise._config_source import load_source
from shardwise.deepspeed_engine.settings import block_json
from shardwise.errors import ConfigError

__all__ = ["engine_config"]


def engine_config(source: Any, kind: str) -> dict[str, Any]:
    """The DeepSpeed JSON of ``source`` (already read, and checked, as a ``kind`` config).

    Raises:
        ConfigError: the source is not a DeepSpeed config.
    """
    src = load_source(source)
    if kind == "deepspeed":
        return copy.deepcopy(dict(src.data))
    if kind == "accelerate" and str(src.data.get("distributed_type", "")).upper() == "DEEPSPEED":
        return block_json(src)
    raise ConfigError.at(src.origin, f"engine=\"deepspeed\" runs a DeepSpeed config (a "
                      "ds_config.json, or an Accelerate config with distributed_type: "
                      f"DEEPSPEED); this is a {kind} config")
