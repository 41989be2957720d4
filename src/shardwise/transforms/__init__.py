# The transforms, one module each.
"""Transforms: small frozen records, each called as ``t(bundle) -> Bundle``.

The native ones, one module each. ``deepspeed()``, which hands the model to DeepSpeed's
own engine, lives with that engine in :mod:`shardwise.deepspeed_engine`.
"""

from shardwise.transforms.accumulate_gradients import AccumulateGradients, accumulate_gradients
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.checkpoint_activations import (
    CheckpointActivations,
    checkpoint_activations,
)
from shardwise.transforms.clip_gradients import ClipGradients, clip_gradients
from shardwise.transforms.compile_blocks import Compile, compile
from shardwise.transforms.distribute_data import DistributeData, distribute_data
from shardwise.transforms.mixed_precision import MixedPrecision, mixed_precision
from shardwise.transforms.offload import Offload, offload
from shardwise.transforms.place import Place, place
from shardwise.transforms.replicate import Replicate, replicate
from shardwise.transforms.shard import Shard, shard
from shardwise.transforms.shard_optimizer import ShardOptimizer, shard_optimizer
from shardwise.transforms.tensor_parallel import TensorParallel, tensor_parallel

__all__ = [
    "AccumulateGradients", "CheckpointActivations", "ClipGradients", "Compile", "DistributeData",
    "MixedPrecision", "Offload", "Place", "Replicate", "Shard", "ShardOptimizer", "Stage", "TensorParallel",
    "Transform",
    "accumulate_gradients", "checkpoint_activations", "clip_gradients", "compile",
    "distribute_data",
    "mixed_precision", "offload", "place", "replicate", "shard", "shard_optimizer",
    "tensor_parallel",
]
