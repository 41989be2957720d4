# The public API of shardwise, and nothing else: one table of names, each imported on first use.
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
from typing import Any

#: every public name and the module that defines it ("": a submodule of shardwise itself).
#: The one list: ``__all__``, the lazy import below and the type checkers' stub
#: ``__init__.pyi`` (written by ``tools/public_stub.py``, checked by a test) all come from
#: it. ``import shardwise`` imports nothing heavy (not even torch), so ``shardwise --help``
#: starts at once; no module shares its name with a public function, so importing a
#: module never hides one.
PUBLIC: dict[str, str] = {
    **dict.fromkeys(["errors", "policies", "testing"], ""),
    **dict.fromkeys(["Bundle"], "shardwise.bundle"),
    **dict.fromkeys(["find_executable_batch_size", "largest_batch_size"], "shardwise.batch_size"),
    **dict.fromkeys(["latest_checkpoint"], "shardwise.checkpoint.layout"),
    **dict.fromkeys(["load", "save"], "shardwise.checkpoint.save_load"),
    **dict.fromkeys(["AsyncSave"], "shardwise.checkpoint.background"),
    **dict.fromkeys(["pipeline", "from_config", "from_ddp_args", "from_training_args"],
                    "shardwise.configured"),
    **dict.fromkeys(["to_device"], "shardwise.data"),
    **dict.fromkeys(["ensure_process_group", "main_process_first"], "shardwise.distributed"),
    **dict.fromkeys(["CONFIG_ENV_VAR", "Env", "detect"], "shardwise.env"),
    **dict.fromkeys(["export", "load_pretrained"], "shardwise.checkpoint.full_weights"),
    **dict.fromkeys(["Logger", "TensorBoardLogger"], "shardwise.loggers"),
    **dict.fromkeys(["MLflowTracker", "TrackioTracker", "WandbTracker", "register_tracker"],
                    "shardwise.trackers"),
    **dict.fromkeys(["evaluate"], "shardwise.evaluation"),
    **dict.fromkeys(["fit"], "shardwise.loop"),
    **dict.fromkeys(["MemoryEstimate", "estimate_memory"], "shardwise.memory"),
    **dict.fromkeys(["init_on_meta"], "shardwise.meta_init"),
    **dict.fromkeys(["gather_for_metrics", "reduce"], "shardwise.metrics"),
    "Pipeline": "shardwise.pipelines",
    **dict.fromkeys(["auto", "by_class", "by_size"], "shardwise.policies"),
    **dict.fromkeys(["Plan"], "shardwise.plan"),
    **dict.fromkeys(["StepOutput", "TrainState"], "shardwise.state"),
    **dict.fromkeys(["accumulate_gradients"], "shardwise.transforms.accumulation"),
    **dict.fromkeys(["Transform"], "shardwise.transforms.base"),
    **dict.fromkeys(["checkpoint_activations"], "shardwise.transforms.activation_checkpointing"),
    **dict.fromkeys(["clip_gradients"], "shardwise.transforms.clipping"),
    **dict.fromkeys(["compile"], "shardwise.transforms.compile_blocks"),
    **dict.fromkeys(["context_parallel"], "shardwise.transforms.context_parallelism"),
    **dict.fromkeys(["deepspeed"], "shardwise.deepspeed_engine.transform"),
    **dict.fromkeys(["distribute_data"], "shardwise.transforms.data_distribution"),
    **dict.fromkeys(["expert_parallel"], "shardwise.transforms.expert_parallelism"),
    **dict.fromkeys(["fault_tolerant"], "shardwise.fault_tolerance.transform"),
    **dict.fromkeys(["local_sgd", "average_replicas"], "shardwise.transforms.replica_averaging"),
    **dict.fromkeys(["mixed_precision"], "shardwise.transforms.precision_policy"),
    **dict.fromkeys(["offload"], "shardwise.transforms.offloading"),
    **dict.fromkeys(["pipeline_parallel"], "shardwise.transforms.pipeline_parallelism"),
    **dict.fromkeys(["place"], "shardwise.transforms.placement"),
    **dict.fromkeys(["replicate"], "shardwise.transforms.replication"),
    **dict.fromkeys(["shard"], "shardwise.transforms.sharding"),
    **dict.fromkeys(["shard_optimizer"], "shardwise.transforms.optimizer_sharding"),
    **dict.fromkeys(["tensor_parallel"], "shardwise.transforms.tensor_parallelism"),
    **dict.fromkeys(["Trainer", "on_shardwise"], "shardwise.trainer.seam"),
}

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = sorted([*(name for name in PUBLIC if name != "testing"), "__version__"])


def __getattr__(name: str) -> Any:
    """Every public name is imported on first use (``sw.testing`` too: test helpers stay
    out of production imports)."""
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    value = importlib.import_module(f"shardwise.{name}") if not module else \
        getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
