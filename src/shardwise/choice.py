# The default distribution for a model: replicate if it fits, else shard, checkpoint, offload.
"""How a pipeline with no distribution transform chooses one, from the memory estimate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from shardwise.env import Env
from shardwise.errors import PolicyError
from shardwise.memory import SAFE_FRACTION, budget, estimate_memory
from shardwise.transforms.activation_checkpointing import (
    CheckpointActivations,
    checkpoint_activations,
)
from shardwise.transforms.base import Transform
from shardwise.transforms.expert_parallelism import ExpertParallel
from shardwise.transforms.offloading import Offload, offload
from shardwise.transforms.optimizer_sharding import ShardOptimizer
from shardwise.transforms.replication import replicate
from shardwise.transforms.sharding import shard

__all__ = ["SAFE_FRACTION", "choose_distribution", "sample_batch"]

_MIB = 2**20


def sample_batch(loader: Iterable[Any] | None) -> Any:
    """The first batch of a map-style DataLoader, built without iterating it (no RNG use)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    if loader.batch_size is None:
        return None
    size = min(loader.batch_size, len(loader.dataset))  # type: ignore[arg-type]
    return loader.collate_fn([loader.dataset[i] for i in range(size)])


def _candidates(env: Env, given: list[Transform]) -> list[tuple[str, list[Transform]]]:
    has_ckpt = any(isinstance(t, CheckpointActivations) for t in given)
    # offloading to the host frees nothing when the device is the host
    no_offload = any(isinstance(t, Offload) for t in given) or env.device.type == "cpu"
    ckpt: list[Transform] = [] if has_ckpt else [checkpoint_activations()]
    out: list[tuple[str, list[Transform]]] = [("replicate", [replicate()])]
    if any(isinstance(t, ShardOptimizer) for t in given):
        return out  # ZeRO-1 shards the optimizer of a replicated model only
    out.append(("shard", [shard()]))
    if ckpt:
        out.append(("shard + checkpoint_activations", [shard(), *ckpt]))
    if not no_offload:
        out.append(("shard + checkpoint_activations + offload", [shard(), *ckpt, offload()]))
    return out


def choose_distribution(env: Env, given: list[Transform], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None,
                        batch: Any) -> tuple[list[Transform], str]:
    """The distribution transforms for ``model`` under ``env``, and the reason with numbers."""
    if any(isinstance(t, ExpertParallel) for t in given):
        return [replicate()], ("default: expert_parallel splits the experts; the other weights "
                               "are replicated (shard() beside it is not built yet)")
    limit = budget(env)
    if limit is None:
        return [replicate()], (f"default: {env.world_size} processes; device memory unknown, "
                               "so replicate")
    tried: list[str] = []
    frugal: list[Transform] = [replicate()]
    for name, extra in _candidates(env, given):
        try:
            estimate = estimate_memory(model, [*given, *extra], env, batch=batch,
                                       optimizer=optimizer)
        except PolicyError:
            tried.append(f"{name}: no blocks to shard")
            continue
        need = estimate.total_bytes
        tried.append(f"{name} needs {need / _MIB:.1f} MiB")
        frugal = extra
        if need <= limit:
            return extra, (f"default: {'; '.join(tried)} per rank, within "
                           f"{SAFE_FRACTION:.0%} of {env.device} memory "
                           f"({limit / _MIB:.1f} MiB per rank)")
    return frugal, (f"default: {'; '.join(tried)} per rank; none fits in {limit / _MIB:.1f} MiB "
                    "per rank, so the most frugal is used")
