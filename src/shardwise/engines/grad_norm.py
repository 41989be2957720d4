# The gradient norm across meshes and pipeline stages, and clipping by it.
"""One p-norm of all gradients, whatever mesh, placement or pipeline stage holds each."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from shardwise._params import is_dtensor

__all__ = ["total_norm", "clip_across_meshes"]


def total_norm(grads: Iterable[torch.Tensor], norm_type: float, *, stages: int = 1) -> torch.Tensor:
    """The p-norm of all ``grads`` together, whatever mesh and placements each has (one value
    on every rank), with one all-reduce over all ranks.

    torch's ``clip_grad_norm_`` stacks per-tensor norms, which DTensors of different meshes
    or placements cannot do (and a 2-D one reduces in two steps): here each rank takes the
    p-th power of its local parts' norms, weighted by the share of ranks holding that same
    part (a piece replicated over r of the world's w ranks counts r/w on each), and one SUM
    (MAX for the inf-norm) over all ranks adds them up. Any placement but Replicate splits
    (FSDP2 puts a _StridedShard over a tensor-parallel split); a Partial gradient (a torch
    style of the user's may leave one) is summed first. A plain tensor counts as replicated.
    Under pipeline parallelism each rank holds one of ``stages`` stages' parameters, so each
    part is held by ``stages`` times fewer ranks than the world: its share is that much more.
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
            weights.append(pieces * stages / world)
        else:
            parts.append(grad)
            weights.append(stages / world)
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
                       norm_type: float, *, stages: int = 1) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters on several meshes: the same coefficient as torch's
    (``max_norm / (norm + 1e-6)``, at most 1) applied to each rank's part of each gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads, norm_type, stages=stages)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [g.to_local() if is_dtensor(g) else g for g in grads]  # type: ignore[attr-defined]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in local:
        by_device.setdefault(grad.device, []).append(grad)
    for device, members in by_device.items():
        torch._foreach_mul_(members, coefficient.to(device))
    return norm
