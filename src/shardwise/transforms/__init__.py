# The transforms, one module each.
"""Transforms: small frozen records, each called as ``t(bundle) -> Bundle``."""

from shardwise.transforms.accumulate_gradients import AccumulateGradients, accumulate_gradients
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.clip_gradients import ClipGradients, clip_gradients
from shardwise.transforms.distribute_data import DistributeData, distribute_data
from shardwise.transforms.mixed_precision import MixedPrecision, mixed_precision
from shardwise.transforms.place import Place, place
from shardwise.transforms.replicate import Replicate, replicate

__all__ = [
    "AccumulateGradients", "ClipGradients", "DistributeData", "MixedPrecision", "Place",
    "Replicate", "Stage", "Transform", "accumulate_gradients", "clip_gradients",
    "distribute_data", "mixed_precision", "place", "replicate",
]
