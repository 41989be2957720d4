# TPEngine: layers split across the ranks of a tensor-parallel group (DTensors), no data parallelism.
"""The ``tensor_parallel()`` engine, and what tensor parallelism changes for every engine:
parameters on several meshes (split ones on ``tp``, others whole), batches read by a group."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from shardwise.engines.base import Engine, MemoryParts, state_bytes
from shardwise.engines.grad_norm import clip_across_meshes, total_norm
from shardwise.env import Env
from shardwise.parallel.mesh import MeshLayout

__all__ = ["TPEngine", "total_norm", "clip_across_meshes", "tp_shape"]



def tp_shape(model: nn.Module, tensor_parallel: Any, size: int
             ) -> Callable[[torch.Tensor], tuple[int, ...]]:
    """The shape of each parameter one rank of a tensor-parallel group holds."""
    shapes = tensor_parallel.local_shapes(model, size)
    return lambda p: shapes.get(id(p), tuple(p.shape))


@attrs.frozen
class TPEngine(Engine):
    """Tensor parallelism over all ``tp`` ranks, with no data dimension: each rank holds its
    part of the split layers, every rank reads the same batch.

    Attributes:
        mesh: the pipeline's mesh layout (one ``tp`` dimension over the world).
        tensor_parallel: the transform (for the memory estimate's split shapes).
    """

    mesh: MeshLayout
    tensor_parallel: Any = attrs.field(eq=False, repr=False, default=None)
    name: ClassVar[str] = "tensor parallel"

    @property
    def tp(self) -> int:
        """Ranks in the tensor-parallel group (the world)."""
        return self.mesh.tp

    def clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return clip_across_meshes(params, max_norm, norm_type)

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        shape = tp_shape(model, self.tensor_parallel, self.tp)
        params, grads, opt = state_bytes(model, trained, optimizer_layout,
                                         numel=lambda p: math.prod(shape(p)))
        # DTensor's embedding backward leaves a rowwise-split table's gradient whole
        whole = self.tensor_parallel.whole_gradients(model, self.tp)
        grads += sum((p.numel() - math.prod(shape(p))) * 4 for p in model.parameters()
                     if id(p) in whole and id(p) in trained)
        return MemoryParts(params, grads, opt, 0, f"tensor parallel over {self.tp} ranks")

    def describe(self, env: Env) -> str:
        return f"tensor parallel over {self.tp} ranks, no data parallelism"
