# Evaluation across ranks: gather_for_metrics (padding dropped) and reduce.
"""Exact metrics on any world size.

A distributed loader gives every rank the same number of samples, so the last samples of
some ranks repeat the dataset's first ones (``DistributedSampler`` pads). A metric over the
gathered values is exact only once those are dropped: :func:`gather_for_metrics` knows from
the loader which items of the current batch are padding on which rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise._text import short
from shardwise.data import DeviceLoader
from shardwise.errors import ArgumentError, DataError

__all__ = ["gather_for_metrics", "reduce"]

ReduceOp = Literal["mean", "sum", "max", "min"]


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _copies(loader: Iterable[Any] | None, world: int) -> int:
    """Ranks that read each batch of ``loader``: a tensor-parallel group's (its sampler splits
    over the data ranks only), else 1."""
    replicas = getattr(getattr(loader, "sampler", None), "num_replicas", None)
    if isinstance(loader, DeviceLoader) and isinstance(replicas, int) and 0 < replicas < world \
            and world % replicas == 0:
        return world // replicas
    return 1


def _real_items(loader: Iterable[Any] | None, world: int) -> list[int] | None:
    """Items of the current batch that are real samples (not padding) on each rank, or None
    when every item is real (or the loader does not say)."""
    if not isinstance(loader, DeviceLoader):
        return None
    sampler = loader.sampler
    size = getattr(loader, "batch_size", None)
    total = getattr(sampler, "total_size", None)
    if size is None or total is None or not hasattr(sampler, "dataset"):
        return None
    samples = len(sampler.dataset)
    if total <= samples:  # no padding (or drop_last dropped the tail)
        return None
    per_rank = total // world
    start = (loader.batch_in_epoch - 1) * size  # this batch's first local index
    end = min(start + size, per_rank)
    if not hasattr(sampler, "position"):  # a DistributedSampler: positions r, r + world, ...
        return [max(0, min(end, math.ceil((samples - r) / world)) - start) for r in range(world)]
    # positions past the dataset's length are padding
    return [sum(sampler.position(i, r) < samples for i in range(start, end))
            for r in range(world)]


def _gather(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    shapes = [torch.zeros(tensor.ndim, dtype=torch.int64, device=tensor.device)
              for _ in range(world)]
    dist.all_gather(shapes, torch.tensor(tensor.shape, device=tensor.device))
    if any(list(s.tolist()) != list(tensor.shape) for s in shapes):
        raise DataError(f"gather_for_metrics() needs the same shape on every rank; got "
                        f"{[tuple(s.tolist()) for s in shapes]} (pad to a common length first)")
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def gather_for_metrics(values: Any, loader: Iterable[Any] | None = None) -> Any:
    """Gather ``values`` of the current batch from every rank, without the padded samples.

    ``values`` is a tensor or a nested tuple/list/dict of tensors whose first dimension is
    the batch (a 0-dim tensor counts as one item per rank). Call it on every rank, once per
    batch of ``loader`` (the bundle's ``eval_loader`` or ``loader``), right after the batch;
    the result is the whole global batch in rank order, on this rank's device. In one
    process the values come back as they are. Under ``tensor_parallel`` the ranks of a group
    hold the same batch: pass the loader, and each group's values are kept once.

    Raises:
        DataError: shapes differ between ranks beyond being a batch of the same size.

    Example:
        >>> for batch in bundle.eval_loader:
        ...     preds = bundle.predict(batch)["logits"].argmax(-1)
        ...     preds, labels = sw.gather_for_metrics((preds, batch["labels"]), bundle.eval_loader)
        ...     correct += (preds == labels).sum().item(); seen += len(labels)
    """
    if not _joined():
        return values
    world = dist.get_world_size()
    copies = _copies(loader, world)
    keep = _real_items(loader, world // copies)
    leaves, spec = tree_flatten(values)
    gathered = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            gathered.append(leaf)
            continue
        parts = _gather(leaf, world)[::copies]  # one rank of each tensor-parallel group
        if keep is not None and leaf.ndim > 0:
            parts = [part[:count] for part, count in zip(parts, keep, strict=True)]
        gathered.append(torch.cat(parts))
    return tree_unflatten(gathered, spec)


def reduce(value: torch.Tensor | float, op: ReduceOp = "mean",
           loader: Iterable[Any] | None = None) -> torch.Tensor:
    """``value`` reduced over all ranks (a collective: every rank calls it).

    Args:
        value: a tensor or a number (a number becomes a float64 tensor on the CPU, which the
            gloo backend reduces; with NCCL pass a tensor on the device).
        op: "mean", "sum", "max" or "min".
        loader: the loader ``value`` was computed from (the bundle's ``eval_loader``, or one
            from ``bundle.distribute``). Under ``tensor_parallel`` or ``context_parallel``
            the ranks of a block read one batch and hold the same value; with the loader,
            a "sum" counts each block's value once (a "mean" is the same either way).

    Example:
        >>> mean_loss = sw.reduce(out.loss)
        >>> total = sw.reduce(loss_sum, "sum", bundle.eval_loader)
    """
    if op not in ("mean", "sum", "max", "min"):
        raise ArgumentError(f"reduce() 'op' must be 'mean', 'sum', 'max' or 'min' (got {short(op)})")
    tensor = (value.detach().clone() if isinstance(value, torch.Tensor)
              else torch.tensor(float(value), dtype=torch.float64))
    if not _joined():
        return tensor
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}
    dist.all_reduce(tensor, op=ops[op])
    if op == "sum":
        return tensor / _copies(loader, dist.get_world_size()) if loader is not None else tensor
    return tensor / dist.get_world_size() if op == "mean" else tensor
