# The transforms, one module each.
"""Transforms: small frozen records, each called as ``t(bundle) -> Bundle``.

The native ones, one module each. ``deepspeed()``, which hands the model to DeepSpeed's
own engine, lives with that engine in :mod:`shardwise.deepspeed_engine`.
"""

from shardwise.transforms.accumulation import AccumulateGradients, accumulate_gradients
from shardwise.transforms.activation_checkpointing import (
    CheckpointActivations,
    checkpoint_activations,
)
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.clipping import ClipGradients, clip_gradients
from shardwise.transforms.compile_blocks import Compile, compile
from shardwise.transforms.context_parallelism import ContextParallel, context_parallel
from shardwise.transforms.data_distribution import DistributeData, distribute_data
from shardwise.transforms.expert_parallelism import ExpertParallel, expert_parallel
from shardwise.transforms.offloading import Offload, offload
from shardwise.transforms.optimizer_sharding import ShardOptimizer, shard_optimizer
from shardwise.transforms.pipeline_parallelism import PipelineParallel, pipeline_parallel
from shardwise.transforms.placement import Place, place
from shardwise.transforms.precision_policy import MixedPrecision, mixed_precision
from shardwise.transforms.replica_averaging import LocalSGD, local_sgd
from shardwise.transforms.replication import Replicate, replicate
from shardwise.transforms.sharding import Shard, shard
from shardwise.transforms.tensor_parallelism import TensorParallel, tensor_parallel

__all__ = [
    "AccumulateGradients", "CheckpointActivations", "ClipGradients", "Compile", "ContextParallel",
    "DistributeData", "ExpertParallel",
    "LocalSGD", "MixedPrecision", "Offload", "PipelineParallel", "Place", "Replicate", "Shard",
    "ShardOptimizer", "Stage",
    "TensorParallel",
    "Transform",
    "accumulate_gradients", "checkpoint_activations", "clip_gradients", "compile", "context_parallel",
    "distribute_data", "expert_parallel", "local_sgd",
    "mixed_precision", "offload", "pipeline_parallel", "place", "replicate", "shard", "shard_optimizer",
    "tensor_parallel",
]
