# ContextSplit: one rank's slice of every sequence, its token-weighted loss and the whole outputs.
"""What ``context_parallel`` does to batches, losses, outputs and attention on one rank.

Every rank of a context-parallel group is given the same batch (checked at the first step).
:meth:`ContextSplit.split` cuts rank r's contiguous r-th of every sequence out of it, with
what a slice needs to mean the same as in the whole sequence: position ids of the whole
sequence, labels shifted *before* the cut (the last token of a slice predicts the first of
the next rank's), no padding mask (attention is causal over the whole sequence; right
padding carries ``-100`` labels, so it changes no loss). The loss of a slice is a sum with
its count of labelled tokens, which the step weighs across the ranks of the group, the
accumulation window and the data ranks as it weighs any ``(loss_sum, num_items)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from shardwise.engines.step_hooks import IGNORE, call_model
from shardwise.errors import ConflictError, LossError
from shardwise.parallel.ulysses import Attend, sequence_slice, ulysses_attention

__all__ = ["ContextSplit", "IGNORE", "REGISTRY_NAME", "ADDED", "next_token_labels",
           "causal_lm_loss"]

#: the name shardwise's attention function is registered under in Transformers' registry
REGISTRY_NAME = "shardwise_context_parallel"


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's label for the next token (``[batch, sequence]``), ``-100`` at each
    sequence's end: a causal LM's shift, done before a batch is cut (into slices here, into
    microbatches by ``pipeline_parallel``)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], 1)


def causal_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' causal LM loss as a sum over the labelled tokens (logits upcast to
    fp32, ``-100`` ignored), with their count; ``target`` already shifted."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten().to(logits.device),
                           ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()


def _sequence_length(batch: Mapping[str, Any]) -> int:
    for key in ("input_ids", "inputs_embeds", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return int(value.shape[1])
    raise ConflictError(f"context_parallel splits sequences along dim 1 of 'input_ids' (or "
                        f"'inputs_embeds' / 'labels'); this batch has none (keys: "
                        f"{sorted(map(str, batch))})")


def _check_padding(mask: torch.Tensor) -> None:
    """Accept an attention mask of ones, or ones then zeros in each row (right padding)."""
    if mask.ndim != 2:
        raise ConflictError(f"context_parallel handles a 2-D padding mask [batch, sequence] only; "
                            f"got an attention_mask of shape {tuple(mask.shape)} (a custom "
                            "mask cannot be split with the sequence)")
    ones = mask != 0
    # right padding: once a row has a zero, it has no one after it
    if bool((ones[:, 1:] & ~ones[:, :-1]).any()):
        raise ConflictError("context_parallel attends causally over whole sequences, which is "
                            "exact for right padding only; this attention_mask has a zero before "
                            "a one (left padding, or packed documents): pad on the right "
                            "(tokenizer.padding_side = 'right')")


#: what a split adds to a batch; a model whose forward takes none of them is not given them
ADDED = ("position_ids", "shift_labels", "num_items_in_batch")


def _for(model: torch.nn.Module, part: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``part`` without the keys the split added that ``model``'s forward does not take (a
    model of one's own; a wrapper's inner module is asked)."""
    forward = getattr(model, "module", model).forward
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return part
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return part
    names = {p.name for p in parameters}
    if "labels" in part and not {"shift_labels", "num_items_in_batch"} <= names:
        raise ConflictError(f"under context_parallel a batch with labels is given to the model "
                            f"with shift_labels and num_items_in_batch (its loss over a slice, "
                            f"as a sum), which {type(model).__name__}.forward does not take; "
                            "predict without labels, or use a loss_fn")
    return {k: v for k, v in part.items() if k in names or k in given or k not in ADDED}


@attrs.frozen
class ContextSplit:
    """One rank's place in a context-parallel group, and what it does with a batch.

    Attributes:
        group: the group's process group.
        rank: this rank's place in it (its slice of every sequence).
        size: ranks in the group.
        method: "ulysses".
    """

    group: Any = attrs.field(eq=False, repr=False)
    rank: int
    size: int
    method: str = "ulysses"
    #: the slice length of the last batch split (what attention must be given)
    lengths: list[int] = attrs.field(factory=list, eq=False, repr=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextSplit:
        """The same split (a process group cannot be copied): a deep copy of a hooked model
        (an EMA or reference copy) shares it."""
        return self

    def split(self, batch: Any) -> dict[str, Any]:
        """This rank's slice of ``batch`` (a mapping): every ``[batch, sequence, ...]`` tensor
        sliced along the sequence, ``position_ids`` of the whole sequence, ``labels`` and
        ``shift_labels`` both the next token's label (shifted before the cut, ``-100`` at each
        sequence's end), no ``attention_mask`` (checked to be right padding).

        Raises:
            ConflictError: not a mapping, a sequence length the size does not divide (named),
                a mask other than right padding.
        """
        if not isinstance(batch, Mapping):
            raise ConflictError(f"context_parallel splits mapping batches (input_ids, labels, "
                                f"...); got a {type(batch).__name__}")
        length = _sequence_length(batch)
        if length % self.size:
            raise ConflictError(f"context_parallel(size={self.size}) splits each sequence into "
                                f"{self.size} equal slices; got sequence length {length}, which "
                                f"{self.size} does not divide: pad to a multiple of {self.size}")
        out = {k: v for k, v in batch.items() if k not in ("attention_mask", "shift_labels")}
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            _check_padding(mask)
        positions = batch.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.shape[-1] > 1 and \
                bool((positions.diff(dim=-1) != 1).any()):
            raise ConflictError("context_parallel attends causally over whole sequences; these "
                                "position_ids do not rise by 1 along the sequence (packed "
                                "documents, whose attention stops at each document's start): "
                                "not supported; pass one document per sequence")
        labels = batch.get("shift_labels", batch.get("labels"))
        if isinstance(labels, torch.Tensor) and "shift_labels" not in batch:
            labels = next_token_labels(labels)
        reference = batch.get("input_ids", batch.get("inputs_embeds"))
        if "position_ids" not in out and isinstance(reference, torch.Tensor):
            out["position_ids"] = torch.arange(length, device=reference.device).expand(
                reference.shape[0], length)
        for key, value in list(out.items()):
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length:
                out[key] = sequence_slice(value, self.rank, self.size).contiguous()
        self.lengths[:] = [length // self.size]
        if isinstance(labels, torch.Tensor):
            out["labels"] = out["shift_labels"] = sequence_slice(labels, self.rank,
                                                                self.size).contiguous()
        return out

    def loss(self, model: torch.nn.Module, batch: Any,
             loss_fn: Callable[[torch.nn.Module, Any], Any] | None) -> tuple[torch.Tensor, Any]:
        """``(loss_sum, labelled tokens)`` of this rank's slice: the user's ``loss_fn`` on the
        sliced batch, or the model's own loss (a Transformers model given ``shift_labels``
        and ``num_items_in_batch=1``, which makes it a sum).

        Raises:
            LossError: ``loss_fn`` returned a plain loss, or the batch has no labels.
        """
        part = self.split(batch)
        if loss_fn is not None:
            result = loss_fn(model, part)
            if not isinstance(result, tuple):
                raise LossError("under context_parallel loss_fn must return (loss_sum, "
                                "num_tokens) for its slice of the sequences (batch['labels'] are "
                                "already shifted: do not shift them again), so that the step "
                                "weighs each token once; it returned a plain loss")
            return result
        labels = part.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise LossError("context_parallel computes the model's loss from the batch's "
                            "'labels', which this batch lacks; add them, or pass loss_fn "
                            "returning (loss_sum, num_tokens)")
        out = call_model(model, {**part, "num_items_in_batch": 1})
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise LossError("context_parallel found no loss in the model's output (it passes "
                            "labels, shift_labels and num_items_in_batch=1, as Transformers' "
                            "causal LMs take them); pass loss_fn returning (loss_sum, num_tokens)")
        return loss, (labels != IGNORE).sum()

    def predict(self, model: torch.nn.Module, batch: Any) -> Any:
        """The model's output for the whole batch, on every rank of the group: each rank runs
        its slice, the outputs' sequence dimension is gathered, and ``loss`` is the mean over
        the whole batch's labelled tokens (each counted once)."""
        part = self.split(batch)
        labels = part.get("labels")
        if isinstance(labels, torch.Tensor):
            part["num_items_in_batch"] = 1
        out = call_model(model, _for(model, part, batch))
        length = self.lengths[0]  # this rank's slice, as split() cut it
        if isinstance(out, torch.Tensor):
            return self.whole(out, length)
        if not isinstance(out, Mapping):
            raise ConflictError(f"under context_parallel predict gathers the outputs of a mapping "
                                f"(a Transformers ModelOutput) or a tensor; the model returned a "
                                f"{type(out).__name__} (pass return_dict=True)")
        for key, value in list(out.items()):
            if key == "loss" and isinstance(labels, torch.Tensor):
                pair = torch.stack([value.detach().double(),
                                    (labels != IGNORE).sum().to(value.device, torch.float64)])
                dist.all_reduce(pair, group=self.group)
                out[key] = (pair[0] / pair[1]).to(value.dtype)  # type: ignore[index]
            else:  # hidden states and attentions come as tuples of tensors
                out[key] = tree_map(lambda v: self.whole(v, length)  # type: ignore[index]
                                    if isinstance(v, torch.Tensor) else v, value)
        return out

    def whole(self, value: torch.Tensor, length: int) -> torch.Tensor:
        """``value`` with its sequence dimension (dim 1, this rank's slice) gathered whole."""
        if value.ndim < 2 or value.shape[1] != length:
            return value
        parts = [torch.empty_like(value) for _ in range(self.size)]
        dist.all_gather(parts, value.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attend: Attend) -> torch.Tensor:
        """Attention over whole sequences for this rank's slices of ``query``, ``key`` and
        ``value`` (``[batch, heads, slice, head_dim]``): ``attend`` runs on whole sequences
        (the hook for a model outside Transformers' registry)."""
        if not self.lengths or query.shape[2] != self.lengths[0]:
            raise ConflictError(f"this attention is context-parallel and expects this rank's "
                                f"slice of {self.lengths[:1] or 'no'} tokens, but was given "
                                f"{query.shape[2]}: call the model through bundle.step and "
                                "bundle.predict, which split the batch (a direct model(...) "
                                "call or generate() gives it whole sequences)")
        return ulysses_attention(query, key, value, attend, self.group)
