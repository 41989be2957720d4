# Plan: the settings the settings-stage transforms record and later stages and the step read.
"""The plan inside every bundle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from shardwise.parallel.mesh import MeshLayout
from shardwise.precision import Precision
from shardwise.state import OnNonFinite

__all__ = ["Plan", "LossFn"]

#: ``loss_fn(model, batch)`` returns a scalar loss, or ``(loss_sum, num_items)``.
LossFn = Callable[[torch.nn.Module, Any], Any]


@attrs.frozen
class Plan:
    """Settings recorded by the settings-stage transforms and read by later stages and the step.

    How a setting is carried out belongs to the engine the distribution transform chose
    (``Bundle.engine``), not to the plan: e.g. bf16 is autocast under DDP and parameter
    casting under FSDP2.

    Attributes:
        precision: compute precision of the forward ("fp32", "bf16", "fp16").
        accumulation_steps: micro-batches per optimizer step.
        close_at_epoch_end: a window also ends with an epoch of ``bundle.loader``.
        max_grad_norm: clip the total gradient norm to this, or ``None``.
        norm_type: the p of the p-norm used for clipping.
        on_nonfinite: what a NaN/inf loss or gradient does in fp32/bf16.
        offload: parameters, gradients and the optimizer step live on the CPU (needs shard).
        tensor_parallel: the ``tensor_parallel`` transform, whose size and plan the data
            split, ``shard()`` and the memory estimate read (None: no tensor parallelism).
        context_parallel: the ``context_parallel`` transform, whose size the data split and
            ``shard()`` read (None: whole sequences on every rank).
        pipeline_parallel: the ``pipeline_parallel`` transform, whose size the data split,
            the step and ``explain()`` read (None: every rank holds every layer).
        local_sgd_every: local SGD: gradients stay on each rank and the replicas' parameters
            are averaged every this many optimizer steps (None: gradients averaged each step);
            beside ``fault_tolerant`` the replicas are its replica groups.
        local_sgd_outer: DiLoCo's outer optimizer factory (across replica groups), or None.
        fault_tolerant: the ``fault_tolerant`` transform, whose replica groups the data
            split reads (None: one job is the whole data-parallel world).
        applied: the transforms applied so far, in order.
        mesh: the mesh's layout, the one value every part reads its sizes from: worked out
            once from every transform's declared dimensions and the env where the pipeline
            builds the plan (:func:`shardwise.transforms.base.plan_for`); None in one process
            or without a mesh dimension.
    """

    precision: Precision = "fp32"
    accumulation_steps: int = 1
    close_at_epoch_end: bool = True
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    on_nonfinite: OnNonFinite = "raise"
    offload: bool = False
    tensor_parallel: Any = None
    context_parallel: Any = None
    pipeline_parallel: Any = None
    local_sgd_every: int | None = None
    local_sgd_outer: Any = None
    fault_tolerant: Any = None
    applied: tuple[Any, ...] = ()
    mesh: MeshLayout | None = None

    def size(self, dim: str) -> int:
        """Ranks along mesh dimension ``dim`` ("tp", "cp", "pp", ...): 1 without it."""
        return self.mesh.size(dim) if self.mesh is not None else 1

    @property
    def copies(self) -> int:
        """Ranks that read each batch: one ``pp x cp x tp`` block of the mesh (1 without)."""
        return self.mesh.copies if self.mesh is not None else 1

    @property
    def splitting(self) -> tuple[Any, ...]:
        """The transforms that give several ranks one batch (``pipeline_parallel``,
        ``tensor_parallel``, ``context_parallel``), those in the plan: what the mesh's
        ``pp x cp x tp`` block is."""
        return tuple(t for t in (self.pipeline_parallel, self.tensor_parallel,
                                 self.context_parallel) if t is not None)
