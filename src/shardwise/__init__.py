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
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time each name is imported on first use
    from shardwise import errors, policies
    from shardwise.bundle import Bundle, Plan
    from shardwise.checkpoint import latest_checkpoint, load, save
    from shardwise.checkpoint_async import AsyncSave
    from shardwise.configured import from_config, from_ddp_args, from_training_args
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
    from shardwise.transforms.accumulate_gradients import accumulate_gradients
    from shardwise.transforms.base import Transform
    from shardwise.transforms.checkpoint_activations import checkpoint_activations
    from shardwise.transforms.clip_gradients import clip_gradients
    from shardwise.transforms.compile_blocks import compile
    from shardwise.transforms.deepspeed import deepspeed
    from shardwise.transforms.distribute_data import distribute_data
    from shardwise.transforms.mixed_precision import mixed_precision
    from shardwise.transforms.offload import offload
    from shardwise.transforms.place import place
    from shardwise.transforms.replicate import replicate
    from shardwise.transforms.shard import shard
    from shardwise.transforms.shard_optimizer import shard_optimizer
    from shardwise.transforms.tensor_parallel import tensor_parallel

#: every public name and the module it comes from, imported on first use: ``import
#: shardwise`` imports nothing heavy (not even torch), so ``shardwise --help`` starts at once
_LAZY = {
    "errors": "shardwise", "policies": "shardwise", "Bundle": "shardwise.bundle",
    "Plan": "shardwise.bundle", "latest_checkpoint": "shardwise.checkpoint",
    "load": "shardwise.checkpoint", "save": "shardwise.checkpoint",
    "AsyncSave": "shardwise.checkpoint_async",
    "to_device": "shardwise.data", "ensure_process_group": "shardwise.distributed",
    "main_process_first": "shardwise.distributed", "CONFIG_ENV_VAR": "shardwise.env",
    "Env": "shardwise.env", "detect": "shardwise.env", "export": "shardwise.export",
    "fit": "shardwise.fit", "Logger": "shardwise.loggers",
    "TensorBoardLogger": "shardwise.loggers", "MemoryEstimate": "shardwise.memory",
    "estimate_memory": "shardwise.memory", "init_on_meta": "shardwise.meta_init",
    "gather_for_metrics": "shardwise.metrics", "reduce": "shardwise.metrics",
    "Pipeline": "shardwise.pipeline", "pipeline": "shardwise.pipeline",
    "auto": "shardwise.policies", "by_class": "shardwise.policies",
    "by_size": "shardwise.policies", "StepOutput": "shardwise.state",
    "TrainState": "shardwise.state",
    **dict.fromkeys(["Transform", "accumulate_gradients", "checkpoint_activations",
                     "clip_gradients", "compile", "deepspeed", "distribute_data", "mixed_precision",
                     "offload", "place", "replicate", "shard", "shard_optimizer",
                     "tensor_parallel"],
                    "shardwise.transforms"),
    **dict.fromkeys(["from_config", "from_ddp_args", "from_training_args"],
                    "shardwise.configured"),
    "testing": "shardwise",
}
#: public functions named like the module they live in: importing the module must not
#: put it in the function's place on the package (the import system binds submodules).
#: ``from shardwise.fit import ...`` reaches the module; ``import shardwise.fit as m`` gives
#: the function
_SHADOWED = {"export", "fit", "pipeline"}


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return  # sys.modules still holds the submodule; the name stays the function's
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncSave",
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
    "compile",
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
    "tensor_parallel",
    "to_device",
]


def __getattr__(name: str) -> Any:
    """Every public name is imported on first use (``sw.testing`` too: test helpers stay
    out of production imports)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    value = importlib.import_module(f"shardwise.{name}") if module == "shardwise" else \
        getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
