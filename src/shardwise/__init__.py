# The public API of shardwise, and nothing else.
"""shardwise: one plain PyTorch training script on a CPU, one GPU or many, via small transforms.

Example:
    >>> import shardwise as sw
    >>> bundle = sw.pipeline(sw.detect())(model, optimizer, loader)
    >>> state = bundle.init()
    >>> for batch in bundle.loader:
    ...     state, out = bundle.step(state, batch)
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from shardwise import errors, policies
from shardwise.bundle import Bundle, Plan
from shardwise.checkpoint import latest_checkpoint, load, save
from shardwise.data import to_device
from shardwise.distributed import ensure_process_group, main_process_first
from shardwise.env import CONFIG_ENV_VAR, Env, detect
from shardwise.export import export
from shardwise.fit import fit
from shardwise.loggers import Logger, TensorBoardLogger
from shardwise.memory import MemoryEstimate, estimate_memory
from shardwise.meta_init import init_on_meta
from shardwise.metrics import gather_for_metrics, reduce
from shardwise.pipeline import Pipeline, pipeline
from shardwise.policies import auto, by_class, by_size
from shardwise.state import StepOutput, TrainState
from shardwise.transforms import (
    Transform,
    accumulate_gradients,
    checkpoint_activations,
    clip_gradients,
    deepspeed,
    distribute_data,
    mixed_precision,
    offload,
    place,
    replicate,
    shard,
    shard_optimizer,
)

if TYPE_CHECKING:  # imported on first use (the config readers and YAML cost ~60 ms)
    from shardwise.configured import from_config, from_ddp_args, from_training_args

#: names imported on first use, by module
_LAZY = {"from_config": "shardwise.configured", "from_ddp_args": "shardwise.configured",
         "from_training_args": "shardwise.configured", "testing": None}

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "CONFIG_ENV_VAR",
    "Bundle",
    "Env",
    "Logger",
    "MemoryEstimate",
    "Pipeline",
    "Plan",
    "StepOutput",
    "TensorBoardLogger",
    "TrainState",
    "Transform",
    "__version__",
    "accumulate_gradients",
    "auto",
    "by_class",
    "by_size",
    "checkpoint_activations",
    "clip_gradients",
    "deepspeed",
    "detect",
    "distribute_data",
    "ensure_process_group",
    "latest_checkpoint",
    "load",
    "estimate_memory",
    "export",
    "fit",
    "from_config",
    "from_ddp_args",
    "from_training_args",
    "gather_for_metrics",
    "main_process_first",
    "reduce",
    "init_on_meta",
    "errors",
    "policies",
    "mixed_precision",
    "offload",
    "pipeline",
    "place",
    "replicate",
    "save",
    "shard",
    "shard_optimizer",
    "to_device",
]


def __getattr__(name: str) -> Any:
    """Names imported on first use: ``sw.testing`` (test helpers stay out of production
    imports) and the config readers (``sw.from_config``, ...)."""
    if name == "testing":
        return importlib.import_module("shardwise.testing")
    if name in _LAZY:
        value = getattr(importlib.import_module(str(_LAZY[name])), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
