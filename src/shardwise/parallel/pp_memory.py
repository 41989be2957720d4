# The per-rank memory of pipeline stages: the state a rank's stages hold, activations in flight.
"""What ``estimate_memory`` counts under ``pipeline_parallel``.

Each rank holds its stages' parameters, gradients and optimizer state, and the activations
of the microbatches whose forward it ran and whose backward it has not: how many depends on
the schedule. That is read from torch's own schedule (``Schedule.order``: its ``pipeline_order``, the
compute actions of every rank, built from stand-in stages: nothing runs): each forward of a stage
adds that stage's activations for one microbatch (estimated on the meta device), each
backward frees them (for the zero-bubble schedules, the weight-gradient half: until then the
layers' inputs are kept), and the peak of the running sum is the rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.parallel.pp_stages import DecoderStage, StageSplit, decoder_parts, stage_modules

__all__ = ["held_modules", "in_flight", "microbatch", "stage_activations"]


def held_modules(model: nn.Module, split: StageSplit, mine: Sequence[int]) -> nn.Module:
    """The modules the stages ``mine`` hold, in one container (for their state's bytes): its
    ``layers`` the held layers (the blocks a sharding policy finds, as in the model), its
    ``rest`` the embeddings, norm and head the stages hold."""
    held = sorted({i for stage in mine for i in range(*split.bounds[stage])})
    holder = nn.Module()
    holder.__dict__["cut_from"] = model  # not a submodule: what a plan of names resolves on
    holder._no_split_modules = getattr(model, "_no_split_modules", None)  # type: ignore[assignment]
    if split.kind == "sequential":
        children = list(model.children())
        holder.layers = nn.ModuleList([children[i] for i in held])
        holder.rest = nn.ModuleList()
        return holder
    _, inner = decoder_parts(model)  # type: ignore[misc]
    holder.layers = nn.ModuleList([inner.layers[i] for i in held])
    rest: list[nn.Module] = [inner.embed_tokens] if 0 in mine else []
    if split.stages - 1 in mine:
        rest += [inner.norm, model.lm_head]  # type: ignore[list-item]
    holder.rest = nn.ModuleList(rest)
    return holder


def in_flight(actions: list[Any], per_stage: Callable[[int], int]) -> int:
    """The peak bytes of activations held while a rank runs ``actions``: a forward of stage s
    adds ``per_stage(s)``; its full backward, or the weight-gradient half of a split one,
    frees them."""
    held = peak = 0
    for action in actions:
        parts = getattr(action, "sub_actions", None) or [action]
        for part in parts:
            kind = str(part.computation_type).rsplit(".", 1)[-1]
            if kind in ("FORWARD", "F"):
                held += per_stage(part.stage_index)
            elif kind in ("FULL_BACKWARD", "B", "BACKWARD_WEIGHT", "W"):
                held -= per_stage(part.stage_index)
            peak = max(peak, held)
    return peak


def microbatch(batch: Any, microbatches: int) -> Any:
    """``batch`` cut to its first microbatch (every tensor's leading dimension / the count)."""
    leaves = [v for v in tree_flatten(batch)[0] if isinstance(v, torch.Tensor) and v.ndim]
    size = int(leaves[0].shape[0]) if leaves else 1
    step = max(1, -(-size // microbatches))  # a short batch is padded up, as the run pads it
    return tree_map(lambda v: v[:step] if isinstance(v, torch.Tensor) and v.ndim and
                    v.shape[0] == size else v, batch)


def stage_activations(model: nn.Module, split: StageSplit, batch: Any,
                      measure: Callable[[nn.Module, Any], int | None],
                      dtype: torch.dtype) -> list[int | None]:
    """Each stage's activations for one microbatch ``batch``: ``measure(stage, inputs)``, the
    stages run one after another on the meta device to learn each one's input (hidden states
    in ``dtype``, the forward's precision)."""
    stages = stage_modules(model, split, range(split.stages))
    if split.kind == "decoder":
        inputs: Any = (batch["input_ids"] if isinstance(batch, dict) else batch,)
        for stage in stages:  # the model's own default: without a cache Transformers reads
            if isinstance(stage, DecoderStage):  # the (meta) position ids to detect packing
                stage.use_cache = None
    else:
        inputs = (batch[0],) if isinstance(batch, (tuple, list)) else (batch,)
    out: list[int | None] = []
    for stage in stages:
        out.append(measure(stage, inputs))
        if split.kind == "decoder":  # the hidden states the next stage starts from
            ids = inputs[0]
            width = decoder_parts(model)[1].embed_tokens.embedding_dim  # type: ignore[index]
            inputs = (torch.empty(*ids.shape[:2], width, device="meta", dtype=dtype),)
            continue
        meta = {n: torch.empty_like(p, device="meta") for n, p in stage.named_parameters()}
        meta.update({n: torch.empty_like(b, device="meta") for n, b in stage.named_buffers()})
        with torch.no_grad():
            following = functional_call(stage, meta, tuple(
                v.to("meta") if isinstance(v, torch.Tensor) else v for v in inputs))
        inputs = (following.to(dtype) if following.is_floating_point() else following,)
    return out
