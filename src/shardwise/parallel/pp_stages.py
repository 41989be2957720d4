# Pipeline stages of a model: where it is cut, the module each stage runs, what each rank keeps.
"""A model cut into pipeline stages at layer boundaries, its parameter names unchanged.

Two kinds of model are cut: a Transformers decoder (``embed_tokens``, a list of ``layers``,
``norm`` and ``lm_head``: embeddings on the first stage, final norm and head on the last) and
an ``nn.Sequential`` (its children in order). :func:`split_of` decides the layers of each
stage (balanced by parameter count, or at the module names a user gives); :func:`prune`
replaces in the model what this rank's stages do not hold by :class:`Elsewhere` (no
parameters), so its state dict holds this rank's part under the model's own names;
:func:`stage_modules` gives each of this rank's stages the module the schedule runs: a view of
the model whose other stages' modules are :class:`Elsewhere`, sharing this rank's modules (a
Transformers decoder runs its own forward, entering at ``inputs_embeds`` after the first
stage, so masks, rotary embeddings and any model-specific step stay its own).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
from torch import nn

from shardwise._text import short
from shardwise.errors import ArgumentError, ConflictError

__all__ = ["cut_from", "Elsewhere", "DecoderStage", "StageSplit", "split_of", "prune",
           "stage_modules", "check_views", "decoder_parts"]

Kind = Literal["decoder", "sequential"]


class Elsewhere(nn.Module):
    """Stands for a module another stage holds: no parameters; passes its first input on.
    ``names`` keeps the names of the submodules it stands for (relative, ``""`` for the
    module itself), so that a plan naming modules of the whole model can tell a module held
    elsewhere from one that does not exist."""

    def __init__(self, replaced: nn.Module | None = None) -> None:
        super().__init__()
        self.names: tuple[str, ...] = tuple(name for name, _ in replaced.named_modules()) \
            if replaced is not None else ()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def decoder_parts(model: nn.Module) -> tuple[str, Any] | None:
    """``(prefix, inner model)`` of a Transformers decoder with ``embed_tokens``, ``layers``
    (a ModuleList), ``norm`` and an ``lm_head``; None for any other module."""
    prefix = getattr(model, "base_model_prefix", None)
    inner = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(inner, nn.Module) or not isinstance(getattr(model, "lm_head", None),
                                                           nn.Module):
        return None
    if not all(isinstance(getattr(inner, name, None), nn.Module)
               for name in ("embed_tokens", "norm")) or \
            not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return None
    return str(prefix), inner


def _count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


@attrs.frozen
class StageSplit:
    """Where a model is cut.

    Attributes:
        kind: "decoder" (a Transformers decoder) or "sequential".
        bounds: for each stage, the layers ``[start, end)`` it holds.
        layer_names: each layer's name in the model (``model.layers.3``, or ``3``).
        params: each stage's parameters (embeddings on the first, norm and head on the last).
    """

    kind: Kind
    bounds: tuple[tuple[int, int], ...]
    layer_names: tuple[str, ...]
    params: tuple[int, ...]

    @property
    def stages(self) -> int:
        """The number of stages."""
        return len(self.bounds)

    def describe(self) -> str:
        """``stage 0: model.layers.0-1 (+ embeddings), 1.2M parameters; ...``."""
        parts = []
        for index, (start, end) in enumerate(self.bounds):
            names = self.layer_names[start] if end - start == 1 else \
                f"{self.layer_names[start]}-{self.layer_names[end - 1].rsplit('.', 1)[-1]}"
            extra = [what for what, here in (("embeddings", index == 0),
                                             ("norm and head", index == self.stages - 1))
                     if here and self.kind == "decoder"]
            held = f"{names} (+ {', '.join(extra)})" if extra else names
            parts.append(f"stage {index}: {held}, {self.params[index] / 1e6:.3g}M parameters")
        return "; ".join(parts)


def _layers(model: nn.Module) -> tuple[Kind, list[nn.Module], list[str], int, int]:
    """The kind, the layers in order, their names, and the parameters before the first and
    after the last layer (embeddings; norm and head)."""
    parts = decoder_parts(model)
    if parts is not None:
        prefix, inner = parts
        layers = list(inner.layers)
        names = [f"{prefix}.layers.{i}" for i in range(len(layers))]
        head: Any = model.lm_head
        tied = head.weight is inner.embed_tokens.weight
        return ("decoder", layers, names, _count(inner.embed_tokens),
                _count(inner.norm) + (0 if tied else _count(head)))
    if isinstance(model, nn.Sequential):
        return "sequential", list(model.children()), [name for name, _ in model.named_children()], 0, 0
    raise ConflictError(f"pipeline_parallel cuts a Transformers decoder (embed_tokens, layers, "
                        f"norm, lm_head) or an nn.Sequential at layer boundaries; got a "
                        f"{type(model).__name__}: write it as an nn.Sequential of its blocks")


def _balanced(costs: list[int], stages: int, first: int, last: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``costs`` for ``stages`` stages (each at least one layer) whose
    largest total (``first`` added to stage 0, ``last`` to the last) is smallest."""
    count = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def total(stage: int, start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (first if stage == 0 else 0) + \
            (last if stage == stages - 1 else 0)

    # best[s][e]: the smallest largest stage over stages 0..s holding layers [0, e)
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(stages)]
    cut = [[0] * (count + 1) for _ in range(stages)]
    for end in range(1, count + 1):
        best[0][end] = total(0, 0, end)
    for stage in range(1, stages):
        for end in range(stage + 1, count + 1):
            for start in range(stage, end):
                worst = max(best[stage - 1][start], total(stage, start, end))
                if worst < best[stage][end]:
                    best[stage][end], cut[stage][end] = worst, start
    bounds, end = [], count
    for stage in range(stages - 1, -1, -1):
        start = cut[stage][end] if stage else 0
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def split_of(model: nn.Module, stages: int, split: str | Sequence[str]) -> StageSplit:
    """Where ``model`` is cut into ``stages`` stages: ``"auto"`` balances the stages'
    parameters (embeddings counted on the first, norm and head on the last); a list of
    ``stages - 1`` layer names says where stages 1, 2, ... begin.

    Raises:
        ConflictError: a model that cannot be cut, more stages than layers.
        ArgumentError: a split naming no layer, out of order, or of the wrong length.
    """
    kind, layers, names, first, last = _layers(model)
    if stages > len(layers):
        raise ConflictError(f"pipeline_parallel needs at least one layer per stage: {stages} "
                            f"stages, but the model has {len(layers)} layers ({names[0]} .. "
                            f"{names[-1]}); use at most {len(layers)} stages (fewer ranks or "
                            "stages per rank)")
    costs = [_count(layer) for layer in layers]
    if split == "auto":
        bounds = _balanced(costs, stages, first, last)
    else:
        given = list(split)
        if len(given) != stages - 1 or not all(isinstance(n, str) for n in given):
            raise ArgumentError(f"pipeline_parallel() 'split' must be 'auto' or {stages - 1} layer "
                                f"name(s) where stages 1..{stages - 1} begin (got {short(split)})")
        unknown = [n for n in given if n not in names]
        if unknown:
            raise ArgumentError(f"pipeline_parallel() 'split' names {short(unknown[0])}, which is "
                                f"not a layer of the model; its layers are {names[0]} .. "
                                f"{names[-1]}")
        starts = [0, *(names.index(n) for n in given), len(layers)]
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ArgumentError(f"pipeline_parallel() 'split' {given} must name layers in "
                                f"order, after {names[0]}, each stage at least one layer")
        bounds = list(zip(starts, starts[1:], strict=False))
    params = tuple(sum(costs[a:b]) + (first if i == 0 else 0) + (last if i == stages - 1 else 0)
                   for i, (a, b) in enumerate(bounds))
    return StageSplit(kind, tuple(bounds), tuple(names), params)


def _held(split: StageSplit, mine: Sequence[int]) -> set[int]:
    return {i for stage in mine for i in range(*split.bounds[stage])}


def _with(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose named children are replaced (the others shared)."""
    view = copy.copy(module)
    view._modules = {**module._modules, **children}
    return view


def _decoder_view(model: nn.Module, held: set[int], first: bool, last: bool) -> nn.Module:
    prefix, inner = decoder_parts(model)  # type: ignore[misc]
    layers = nn.ModuleList([layer if i in held else Elsewhere()
                            for i, layer in enumerate(inner.layers)])
    replaced: dict[str, nn.Module] = {"layers": layers}
    if not first:
        replaced["embed_tokens"] = Elsewhere()
    if not last:
        replaced["norm"] = Elsewhere()
    top: dict[str, nn.Module] = {prefix: _with(inner, **replaced)}
    if not last:
        top["lm_head"] = Elsewhere()
    return _with(model, **top)


def prune(model: nn.Module, split: StageSplit, mine: Sequence[int]) -> None:
    """Replace in ``model`` (in place) every layer, embedding, norm and head that none of the
    stages ``mine`` holds by :class:`Elsewhere`: its parameters are freed, and the state
    dict holds this rank's part under the model's own names."""
    held = _held(split, mine)
    if split.kind == "sequential":
        for index, name in enumerate(split.layer_names):
            if index not in held:
                model._modules[name] = Elsewhere(model._modules[name])
        return
    _, inner = decoder_parts(model)  # type: ignore[misc]
    for index in range(len(split.layer_names)):
        if index not in held:
            inner.layers[index] = Elsewhere(inner.layers[index])
    if 0 not in mine:
        inner.embed_tokens = Elsewhere(inner.embed_tokens)
    if split.stages - 1 not in mine:
        inner.norm = Elsewhere(inner.norm)
        model.lm_head = Elsewhere(model.lm_head)  # type: ignore[arg-type]


def all_module_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules before it was cut: those it holds and those an
    :class:`Elsewhere` stands for (never the ``Elsewhere`` itself)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Elsewhere):
            names += [f"{name}.{inner}" if inner and name else inner or name
                      for inner in module.names]
        else:
            names.append(name)
    return names


class DecoderStage(nn.Module):
    """One stage of a Transformers decoder: its view of the model, run from ``input_ids``
    (first stage) or the previous stage's hidden states (``inputs_embeds``), returning hidden
    states, or the logits on the last stage."""

    def __init__(self, view: nn.Module, prefix: str, first: bool, last: bool) -> None:
        super().__init__()
        self.view, self.prefix, self.first, self.last = view, prefix, first, last
        #: training keeps no key/value cache (None: the model's default, for the estimate)
        self.use_cache: bool | None = False

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        given: dict[str, Any] = {"input_ids" if self.first else "inputs_embeds": x,
                                 "use_cache": self.use_cache}
        if attention_mask is not None:
            given["attention_mask"] = attention_mask
        if position_ids is not None:  # a context-parallel slice's place in the sequence
            given["position_ids"] = position_ids
        if self.last:
            return self.view(**given).logits
        # the base model's output: hidden states the last layer made (never a view, which
        # the zero-bubble schedules' backward cannot detach in place)
        return getattr(self.view, self.prefix)(**given).last_hidden_state


def stage_modules(model: nn.Module, split: StageSplit, mine: Sequence[int]) -> list[nn.Module]:
    """The module each stage of ``mine`` runs, sharing ``model``'s layers."""
    out: list[nn.Module] = []
    for stage in mine:
        held, first, last = _held(split, [stage]), stage == 0, stage == split.stages - 1
        if split.kind == "sequential":
            start, end = split.bounds[stage]
            out.append(nn.Sequential(*list(model.children())[start:end]))
        else:
            prefix, _ = decoder_parts(model)  # type: ignore[misc]
            out.append(DecoderStage(_decoder_view(model, held, first, last), prefix, first, last))
    return out


def check_views(model: nn.Module, split: StageSplit) -> None:
    """Run the whole (not yet pruned) decoder and its stages one after another on a few
    tokens, and refuse a model whose stages do not compose to its forward (one that does
    more than embeddings, layers, norm and head: scaled embeddings, say). Skipped for a model
    on the meta device."""
    if split.kind != "decoder" or any(p.is_meta for p in model.parameters()):
        return
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) % vocab)[None]
    stages = stage_modules(model, split, range(split.stages))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits
            staged = ids
            for module in stages:
                staged = module(staged)
    finally:
        model.train(was_training)
    if not torch.allclose(whole.float(), staged.float(), rtol=1e-4, atol=1e-5):
        difference = (whole.float() - staged.float()).abs().max().item()
        raise ConflictError(f"pipeline_parallel: {type(model).__name__}'s stages, run one after "
                            f"another, do not give its own forward's logits (largest difference "
                            f"{difference:.3g}): its forward does more than embeddings, layers, "
                            "norm and head between them; it cannot be cut at layer boundaries")


def cut_from(module: nn.Module) -> nn.Module:
    """The whole model a ``held_modules`` container (:mod:`shardwise.parallel.pp_memory`) was
    taken from (whose module names a tensor-parallel plan names), or ``module`` itself."""
    return module.__dict__.get("cut_from", module)
