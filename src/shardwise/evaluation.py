# sw.evaluate: the eval loss over a whole loader, each labelled token (or sample) counted once.
"""The evaluation loss ``sw.fit`` logs with ``eval_fn=sw.evaluate``, exact on any layout.

Each batch's loss is taken as a sum with its count, the sums and counts are added over the
batches and all ranks, and the loss is their ratio: one process's mean over the same data,
whatever the data ranks, the context-parallel slices or the tensor-parallel copies. Samples
the distributed loader repeated to even out the last batch are counted nowhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from shardwise.bundle import Bundle
from shardwise.data import DeviceLoader
from shardwise.engines.step_hooks import _loss_of, _sum_and_count, call_model
from shardwise.errors import ArgumentError, DataError, LossError
from shardwise.metrics import _real_items
from shardwise.parallel.context_split import IGNORE, causal_lm_loss
from shardwise.step import forward_autocast

__all__ = ["evaluate"]


def _real_part(batch: Any, loader: Iterable[Any], staged: bool) -> tuple[Any, bool]:
    """``batch`` cut to the samples that are not the loader's repeats, and whether any is left.
    With none left the first sample is kept (and counted nowhere): a sharded forward is a
    collective, so every rank runs one. Through pipeline stages the batch keeps its size
    (one schedule shape for every batch): the repeats' labels become -100 instead.

    Raises:
        DataError: through pipeline stages, repeats in a batch without integer labels.
    """
    sampler = getattr(loader, "sampler", None)
    counts = _real_items(loader, getattr(sampler, "num_replicas", 1))
    size = _batch_size(batch)
    real = size if counts is None else counts[getattr(sampler, "rank", 0)]
    if real >= size:
        return batch, True
    if staged:
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
            raise DataError("evaluate() through pipeline stages drops the samples the "
                            "distributed loader repeats by setting their 'labels' to -100; "
                            "this batch has no integer 'labels': use a dataset the data ranks "
                            "divide, or drop_last=True")
        masked = labels.clone()
        masked[real:] = IGNORE
        return {**batch, "labels": masked}, True
    keep = max(real, 1)
    return tree_map(lambda v: v[:keep] if isinstance(v, torch.Tensor) and v.ndim > 0
                    and v.shape[0] == size else v, batch), real > 0


def _causal_lm(model: torch.nn.Module) -> bool:
    return getattr(model, "loss_type", None) == "ForCausalLM"


def _sum_and_items(bundle: Bundle, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss sum over ``batch`` (its slice under context parallelism) and the
    labelled tokens or samples it counts."""
    if bundle.stages is not None:  # through the stages, shared over the group
        return bundle.stages.evaluate(batch)
    if bundle.context is not None:
        loss, items = bundle.context.loss(bundle.model, batch, bundle.loss_fn)
        return loss, torch.as_tensor(items)
    if bundle.loss_fn is not None:
        result = bundle.loss_fn(bundle.model, batch)
        if isinstance(result, tuple):
            loss, items = _sum_and_count(result)
            return loss, torch.as_tensor(items)
        loss = _loss_of(result)
    else:
        out = call_model(bundle.model, batch)
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if _causal_lm(bundle.engine.unwrap(bundle.model)) and isinstance(labels, torch.Tensor) \
                and isinstance(logits, torch.Tensor):  # Transformers' causal LM loss, as a sum
            return causal_lm_loss(logits[:, :-1], labels[:, 1:])
        loss = _loss_of(out)
    # a plain loss: the mean over the batch's samples (class labels: those not -100)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.ndim == 1 and not labels.is_floating_point():
        items = (labels != IGNORE).sum()
    elif isinstance(labels, torch.Tensor) and labels.ndim > 1:
        raise LossError("evaluate() counts each labelled token once: it needs the loss as a sum "
                        "with its count for these per-token labels; pass loss_fn returning "
                        "(loss_sum, num_tokens) to the pipeline call")
    else:
        items = torch.as_tensor(_batch_size(batch))
    return loss * items.to(loss.dtype), items


def _batch_size(batch: Any) -> int:
    values = batch.values() if isinstance(batch, Mapping) else batch \
        if isinstance(batch, (tuple, list)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    raise LossError(f"evaluate() could not find the batch size of a {type(batch).__name__} "
                    "batch; pass loss_fn returning (loss_sum, num_items)")


def evaluate(bundle: Bundle, loader: Iterable[Any] | None = None) -> dict[str, float]:
    """The loss over all of ``loader`` (the bundle's ``eval_loader`` by default): every
    batch's loss summed with its count, over all batches and ranks, then divided.

    The count: the ``num_items`` of a ``loss_fn`` returning ``(loss_sum, num_items)``; the
    labelled tokens of a Transformers causal LM (its loss taken as a sum: labels shifted,
    ``-100`` ignored); else the batch's samples (a plain loss is a mean over them). So the
    result is one process's mean over the same data on any layout: data ranks, context
    parallel (each rank its slice), tensor parallel (each block once), pipeline parallel
    (through the stages). Every rank calls it
    and gets the same result. Runs without gradients, in eval mode, at training precision.

    Returns:
        ``{"loss": mean, "items": count}``: ``sw.fit(bundle, eval_fn=sw.evaluate,
        eval_every=N)`` logs them as ``eval/loss`` and ``eval/items``.

    Raises:
        ArgumentError: no loader given and the bundle has no ``eval_loader``.
        LossError: per-token labels whose loss is not a sum with its count.

    Example:
        >>> sw.evaluate(bundle)["loss"]
    """
    loader = bundle.eval_loader if loader is None else loader
    if loader is None:
        raise ArgumentError("evaluate() needs a loader: pass one, or build the bundle with "
                            "eval_loader=...")
    joined = dist.is_initialized() and dist.get_world_size() > 1
    if not isinstance(loader, DeviceLoader):
        if bundle.distributor is None and joined:
            raise ArgumentError("evaluate() on several ranks needs a loader distributed as the "
                                "bundle's are (its eval_loader, or bundle.distribute(loader)); "
                                f"got a {type(loader).__name__} every rank would read whole")
        if bundle.distributor is not None:
            loader = bundle.distribute(loader)  # each rank its share, like eval_loader
    env, model = bundle.env, bundle.model
    autocast = forward_autocast(bundle.engine, bundle.plan.precision, env.device)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                batch, counted = _real_part(batch, loader, bundle.stages is not None)
                if autocast is None:
                    loss, items = _sum_and_items(bundle, batch)
                else:
                    with autocast():
                        loss, items = _sum_and_items(bundle, batch)
                if counted:
                    total += torch.stack([loss.detach().to(total), items.to(total)])
    finally:
        model.train(was_training)
    if joined:
        dist.all_reduce(total)
        # the ranks of a tensor-parallel group, and the stages of a pipeline: one batch
        total /= bundle.plan.size("tp") * (bundle.stages.size if bundle.stages else 1)
    loss, items = total.tolist()
    return {"loss": loss / items if items else float("nan"), "items": items}
