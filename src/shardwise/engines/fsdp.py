# FSDPEngine: parameters, gradients and optimizer state sharded by FSDP2 (also HSDP and offload).
"""The ``shard()`` engine."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from shardwise.engines.base import Engine, MemoryParts, state_bytes
from shardwise.engines.step_hooks import NoSync
from shardwise.engines.tp import clip_across_meshes, tp_shape
from shardwise.env import Env
from shardwise.parallel.mesh import MeshLayout
from shardwise.policies import Policy, select
from shardwise.state import TrainState

__all__ = ["FSDPEngine", "shard_numel"]


def shard_numel(param: torch.Tensor | tuple[int, ...], ranks: int) -> int:
    """Elements of the largest shard of ``param`` (or of a tensor of that shape) when FSDP2
    splits dim 0 over ``ranks``."""
    shape = tuple(param.shape) if isinstance(param, torch.Tensor) else param
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / ranks) * rest


@contextlib.contextmanager
def _without_gradient_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@attrs.frozen
class FSDPEngine(Engine):
    """FSDP2 ``fully_shard`` over the data dimensions of a mesh (fewer ranks than the world
    for HSDP, tensor and pipeline parallelism).

    Attributes:
        mesh: the pipeline's mesh layout (or that of a mesh of the user's own): its sizes are
            read from it, never kept here.
        policy: the blocks sharded separately (for the memory estimate).
        reshard_after_forward: free gathered block parameters after forward (ZeRO-3).
        sync_each_batch: reduce-scatter every micro-batch of a window.
        offload: sharded state kept in host memory (``CPUOffloadPolicy``).
        tensor_parallel: the tensor_parallel transform, for the memory estimate.
    """

    mesh: MeshLayout
    policy: Policy
    reshard_after_forward: bool = True
    sync_each_batch: bool = False
    offload: bool = False
    tensor_parallel: Any = attrs.field(eq=False, repr=False, default=None)
    name: ClassVar[str] = "FSDP2"
    casts_parameters: ClassVar[bool] = True
    places_parameters: ClassVar[bool] = True

    @property
    def shard_ranks(self) -> int:
        """The ranks each tensor is split over."""
        return self.mesh.shard_ranks

    @property
    def tp(self) -> int:
        """Ranks of each tensor-parallel group (a data rank holds its part of split layers)."""
        return self.mesh.tp

    @property
    def pp(self) -> int:
        """Ranks of each pipeline group: each shards its stages over the data ranks, and
        torch's schedule reduces the gradients of every batch (no window-long no_sync)."""
        return self.mesh.pp

    def gradient_ranks(self, env: Env) -> int:
        return self.mesh.holders

    def clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        if self.tp > 1:  # split layers on dp x tp, the others on dp alone
            return clip_across_meshes(params, max_norm, norm_type)
        return super().clip(params, max_norm, norm_type)

    def no_sync(self, model: nn.Module, state: TrainState) -> NoSync | None:
        if self.sync_each_batch or self.pp > 1:  # stages: their schedule says when to sync
            return None
        return functools.partial(_without_gradient_sync, model)

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        ranks = self.shard_ranks
        shape = tp_shape(model, self.tensor_parallel, self.tp) if self.tp > 1 \
            else lambda p: tuple(p.shape)
        # without sync_each_batch, unsharded gradients accumulate between reductions
        params, grads, opt = state_bytes(
            model, trained, optimizer_layout, numel=lambda p: shard_numel(shape(p), ranks),
            full_grads=accumulating and not self.sync_each_batch,
            full_numel=lambda p: math.prod(shape(p)))
        layout = f"shard over {ranks} ranks"
        if self.tp > 1:
            layout += f" x tensor parallel over {self.tp}"
        if self.offload and env.device.type != "cpu":
            # sharded parameters, gradients and the optimizer live on the host
            params, grads, opt = 0, 0, 0
            layout += " + CPU offload"
        working = self._working_bytes(model, precision_bytes, lambda p: math.prod(shape(p)))
        return MemoryParts(params, grads, opt, working, layout)

    def _working_bytes(self, model: nn.Module, precision_bytes: int,
                       numel: Callable[[torch.Tensor], int]) -> int:
        """Parameters gathered for compute (over the data ranks; a tensor-parallel rank
        gathers its part only): the root's and the blocks in flight."""
        blocks = [m for _, m in select(self.policy, model, user="estimate_memory")]
        block_numel = [sum(numel(p) for p in b.parameters()) for b in blocks]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = sum(numel(p) for p in model.parameters() if id(p) not in in_blocks)
        gathered = (2 * max(block_numel, default=0) if self.reshard_after_forward
                    else sum(block_numel))
        return (root + gathered) * precision_bytes

    def describe(self, env: Env) -> str:
        split = f", tensor parallel over {self.tp}" if self.tp > 1 else ""
        split += f", pipeline stages over {self.pp}" if self.pp > 1 else ""
        return f"FSDP2 over {self.shard_ranks} of {env.world_size} ranks{split}"
