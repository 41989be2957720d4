# TPEngine: layers split across the ranks of a tensor-parallel group (DTensors), no data parallelism.
"""The ``tensor_parallel()`` engine, and what tensor parallelism changes for every engine:
parameters on several meshes (split ones on ``tp``, others whole), batches read by a group."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from shardwise._params import is_dtensor
from shardwise.engines.base import Engine, MemoryParts, state_bytes
from shardwise.env import Env

__all__ = ["TPEngine", "total_norm", "clip_across_meshes", "tp_shape"]


def total_norm(grads: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The p-norm of all ``grads`` together, whatever mesh and placements each has (one value
    on every rank), with one all-reduce over all ranks.

    torch's ``clip_grad_norm_`` stacks per-tensor norms, which DTensors of different meshes
    or placements cannot do (and a 2-D one reduces in two steps): here each rank takes the
    p-th power of its local parts' norms, weighted by the share of ranks holding that same
    part (a piece replicated over r of the world's w ranks counts r/w on each), and one SUM
    (MAX for the inf-norm) over all ranks adds them up. Any placement but Replicate splits
    (FSDP2 puts a _StridedShard over a tensor-parallel split); a Partial gradient (a torch
    style of the user's may leave one) is summed first. A plain tensor counts as replicated.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    parts: list[torch.Tensor] = []
    weights: list[float] = []
    for grad in grads:
        if is_dtensor(grad):
            dtensor: Any = grad
            if any(p.is_partial() for p in dtensor.placements):  # partial sums: add them first
                from torch.distributed.tensor import Replicate

                dtensor = dtensor.redistribute(dtensor.device_mesh, [
                    Replicate() if p.is_partial() else p for p in dtensor.placements])
            pieces = math.prod(dtensor.device_mesh.size(i) for i, placement
                               in enumerate(dtensor.placements) if not placement.is_replicate())
            parts.append(dtensor.to_local())
            weights.append(pieces / world)
        else:
            parts.append(grad)
            weights.append(1 / world)
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    norms = torch.stack([n.to(device, torch.float32)
                         for n in torch._foreach_norm(parts, norm_type)])
    if math.isinf(norm_type):
        total = norms.max()
        op = dist.ReduceOp.MAX
    else:
        total = (norms.pow(norm_type) * torch.tensor(weights, device=device)).sum()
        op = dist.ReduceOp.SUM
    if world > 1:
        dist.all_reduce(total, op=op)
    return total if math.isinf(norm_type) else total.pow(1 / norm_type)


def clip_across_meshes(params: list[torch.Tensor], max_norm: float,
                       norm_type: float) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters on several meshes: the same coefficient as torch's
    (``max_norm / (norm + 1e-6)``, at most 1) applied to each rank's part of each gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads, norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [g.to_local() if is_dtensor(g) else g for g in grads]  # type: ignore[attr-defined]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in local:
        by_device.setdefault(grad.device, []).append(grad)
    for device, members in by_device.items():
        torch._foreach_mul_(members, coefficient.to(device))
    return norm


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
        tp: ranks in the tensor-parallel group (the world).
        tensor_parallel: the transform (for the memory estimate's split shapes).
    """

    tp: int
    tensor_parallel: Any = attrs.field(eq=False, repr=False, default=None)
    name: ClassVar[str] = "tensor parallel"

    def batch_copies(self, env: Env) -> int:
        return self.tp

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
