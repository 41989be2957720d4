# The public API of shardwise, and nothing else.
"""shardwise: one plain PyTorch training script on a CPU, one GPU or many, via small transforms.

Example:
    >>> import shardwise as sw
    >>> bundle = sw.pipeline(sw.detect())(model, optimizer, loader)
    >>> state = bundle.init()
    >>> for batch in bundle.loader:
    ...     state, out = bundle.step(state, batch)
"""

from importlib.metadata import PackageNotFoundError, version

from shardwise import errors
from shardwise.bundle import Bundle, Plan
from shardwise.data import to_device
from shardwise.distributed import ensure_process_group
from shardwise.env import CONFIG_ENV_VAR, Env, detect
from shardwise.pipeline import Pipeline, pipeline
from shardwise.state import StepOutput, TrainState
from shardwise.transforms import (
    Transform,
    accumulate_gradients,
    clip_gradients,
    distribute_data,
    mixed_precision,
    place,
    replicate,
)

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "CONFIG_ENV_VAR",
    "Bundle",
    "Env",
    "Pipeline",
    "Plan",
    "StepOutput",
    "TrainState",
    "Transform",
    "__version__",
    "accumulate_gradients",
    "clip_gradients",
    "detect",
    "distribute_data",
    "ensure_process_group",
    "errors",
    "mixed_precision",
    "pipeline",
    "place",
    "replicate",
    "to_device",
]
