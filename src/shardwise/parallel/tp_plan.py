# Tensor-parallel plans: a model's own (Transformers') or a user's, checked and turned into torch's styles.
"""Which module is split how under ``tensor_parallel``: patterns, styles, sizes, checks.

A plan maps module-name patterns (``*`` stands for one name part, e.g. a layer number) to a
style. Styles are Transformers' names for torch's own ``ColwiseParallel`` and
``RowwiseParallel`` (or torch ``ParallelStyle`` objects, taken as given). Everything here
is pure: nothing is split, no process group is needed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from shardwise._text import short
from shardwise.errors import ArgumentError, ConflictError

__all__ = ["STYLES", "resolve", "whole_owners", "model_plan", "torch_style", "split_dims", "local_shapes",
           "check_plan_value"]

#: style name -> (kind, output gathered, input replicated): Transformers' names for them
STYLES: dict[str, tuple[str, bool, bool]] = {
    "colwise": ("colwise", False, False),
    "colwise_rep": ("colwise", True, False),
    "colwise_gather_output": ("colwise", True, False),
    "embedding_colwise": ("colwise", True, False),
    "rowwise": ("rowwise", False, False),
    "rowwise_rep": ("rowwise", False, True),
    "rowwise_split_input": ("rowwise", False, True),
    "embedding_rowwise": ("rowwise", False, True),
    # weights whole on every rank, inputs of this rank's own rows or heads (a q/k norm after
    # split projections): the weights' gradients summed across the group
    "replicated_with_grad_allreduce": ("replicated", False, False),
}
_ACCEPTED = ", ".join(STYLES)


def check_plan_value(value: Any) -> None:
    """``"auto"`` or a mapping of module-name patterns to style names / torch styles.

    Raises:
        ArgumentError: naming the entry and what is accepted.
    """
    if value == "auto":
        return
    if not isinstance(value, Mapping) or not value:
        raise ArgumentError(f"tensor_parallel() 'plan' must be 'auto' or a non-empty dict of "
                            f"module-name patterns to styles (got {short(value)})")
    for pattern, style in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise ArgumentError(f"tensor_parallel() 'plan' keys must be module-name patterns "
                                f"like 'layers.*.mlp.up_proj' (got {short(pattern)})")
        if isinstance(style, str):
            if style not in STYLES:
                raise ArgumentError(f"tensor_parallel() plan[{pattern!r}] = {short(style)} is not "
                                    f"a style shardwise maps; accepted: {_ACCEPTED}, or a torch "
                                    "ParallelStyle object")
        elif not _is_torch_style(style):
            raise ArgumentError(f"tensor_parallel() plan[{pattern!r}] must be a style name "
                                f"({_ACCEPTED}) or a torch ParallelStyle (got {short(style)})")


def _is_torch_style(style: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(style, ParallelStyle)


def model_plan(model: nn.Module) -> dict[str, Any]:
    """A Transformers model's own tensor-parallel plan, with full module names.

    Raises:
        ConflictError: the model has none.
    """
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    prefix = getattr(model, "base_model_prefix", "")
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        inner = prefix if prefix and hasattr(model, prefix) else ""
        return {f"{inner}.{k}" if inner else k: v for k, v in base.items()}
    raise ConflictError(f"tensor_parallel(plan='auto'): {type(model).__name__} has no tensor-parallel "
                        "plan of its own (a Transformers model's _tp_plan or "
                        "config.base_model_tp_plan); pass plan={'module.pattern': 'colwise' | "
                        "'rowwise', ...}")


def _matcher(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def _split_by_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module ``expert_parallel`` split (its own
    parameters expert stacks): tensor parallelism leaves it to the dispatch."""
    from shardwise.parallel.moe_dispatch import is_expert_stack

    own = list(module.parameters(recurse=False))
    return bool(own) and all(is_expert_stack(p) for p in own)


def resolve(model: nn.Module, plan: Mapping[str, Any], size: int, *,
            own: bool = False) -> dict[str, Any]:
    """Each module the plan splits, by its full name, with its style; checked against ``size``.
    ``own``: the model's own plan, whose patterns may name modules some of its layers lack
    (a mixture of experts' plan lists the dense layers' MLP): those match nothing, skipped.

    Raises:
        ConflictError: a pattern that matches no module, a module torch cannot split, a
            dimension that does not divide by ``size``, heads that do not, a tied weight.
    """
    from shardwise.parallel.pp_stages import Elsewhere, all_module_names

    # under pipeline_parallel a rank holds its stages' modules; the others are Elsewhere;
    # experts modules expert_parallel split are the dispatch's
    modules = {n: m for n, m in model.named_modules()
               if not isinstance(m, Elsewhere) and not _split_by_experts(m)}
    whole = all_module_names(model)
    chosen: dict[str, Any] = {}
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in STYLES:  # a model's own plan, unchecked
            raise ConflictError(f"tensor_parallel(): {type(model).__name__}'s plan entry "
                                f"{pattern!r} has style {style!r}, which shardwise does not map; "
                                f"accepted: {_ACCEPTED}; pass plan={{...}} with those (or torch "
                                "ParallelStyle objects) instead of 'auto'")
        matcher = _matcher(pattern)
        names = [n for n in modules if n and matcher.fullmatch(n)]
        if not names and not own and not any(n and matcher.fullmatch(n) for n in whole):
            sample = ", ".join(n for n in list(modules)[1:6])
            raise ConflictError(f"tensor_parallel(): plan entry {pattern!r} matches no module of "
                                f"{type(model).__name__} (its modules start {sample}, ...); fix "
                                "the pattern ('*' stands for one name part)")
        for name in names:
            chosen[name] = style
    if own and plan and not chosen and not any(isinstance(m, Elsewhere) for m in model.modules()):
        sample = ", ".join(list(plan)[:3])
        raise ConflictError(f"tensor_parallel(plan='auto'): no entry of {type(model).__name__}'s "
                            f"own plan ({sample}, ...) matches one of its modules, so nothing "
                            "would be split; pass plan={...} with patterns of its modules")
    for name, style in chosen.items():
        _check_module(name, modules[name], style, size)
    _check_heads(model, chosen, size)
    _check_tied(model, chosen)
    whole_owners(model, chosen)
    return chosen


def whole_owners(model: nn.Module, chosen: Mapping[str, Any]) -> list[str]:
    """The modules outside the plan that own parameters (norms, ...): they are kept whole as
    replicated DTensors, so that every parameter is a DTensor of one mesh (torch's foreach
    and fused optimizers cannot mix DTensors and tensors).

    Raises:
        ConflictError: such a module also has submodules (its inputs could not be told apart
            from theirs).
    """
    owners = []
    for name, module in model.named_modules():
        if name in chosen or not any(True for _ in module.parameters(recurse=False)) \
                or _split_by_experts(module):
            continue
        if any(True for _ in module.children()):
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False))
            raise ConflictError(f"tensor_parallel(): {name or 'the root'} "
                                f"({type(module).__name__}) holds parameters of its own ({own}) "
                                "beside submodules; tensor_parallel keeps parameters outside the "
                                "plan whole in leaf modules only: move them into a module of "
                                "their own, or split that module with a torch ParallelStyle")
        owners.append(name)
    return owners


def split_dims(module: nn.Module, style: Any) -> dict[str, int | None]:
    """The dimension each of the module's own parameters is split on (None: replicated)."""
    kind = _kind(style)
    if kind is None or kind == "replicated":
        return {n: None for n, _ in module.named_parameters(recurse=False)}
    if isinstance(module, nn.Embedding):
        return {"weight": 1 if kind == "colwise" else 0}
    if kind == "colwise":
        return {"weight": 0, "bias": 0}
    return {"weight": 1, "bias": None}


def _kind(style: Any) -> str | None:
    if isinstance(style, str):
        return STYLES[style][0]
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def _check_module(name: str, module: nn.Module, style: Any, size: int) -> None:
    if not isinstance(style, str) or STYLES[style][0] == "replicated":
        return  # a torch style object (torch checks what it applies to), or whole weights
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ConflictError(f"tensor_parallel(): {name} ({type(module).__name__}) cannot be split "
                            f"{style!r}: torch's ColwiseParallel/RowwiseParallel split nn.Linear "
                            "and nn.Embedding; pass a torch ParallelStyle for it, or leave it out "
                            "of the plan where its input is whole on every rank (a module left "
                            "out computes on whole tensors)")
    for param_name, dim in split_dims(module, style).items():
        param = getattr(module, param_name, None)
        if dim is None or param is None:
            continue
        if param.shape[dim] % size:
            raise ConflictError(
                f"tensor_parallel(size={size}): {name}.{param_name} of shape "
                f"{tuple(param.shape)} ({style!r}) splits dimension {dim} of size "
                f"{param.shape[dim]}, which does not divide by {size}; choose a size that "
                "divides it")


#: name parts of attention projections, whose split must keep whole heads
_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn",
              "wqkv", "wq", "wk", "wv")


def _check_heads(model: nn.Module, chosen: dict[str, Any], size: int) -> None:
    """Attention heads split with their projections: each rank must hold whole heads."""
    config = getattr(model, "config", None)
    splits_attention = any(_kind(s) == "colwise" and name.rsplit(".", 1)[-1].lower() in _ATTENTION
                           for name, s in chosen.items())
    if config is None or not splits_attention:
        return
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise ConflictError(f"tensor_parallel(size={size}): {type(model).__name__}'s "
                                f"config.{field}={heads} does not divide by {size}; each rank "
                                "must hold whole attention heads, choose a size that divides it")


def _check_tied(model: nn.Module, chosen: dict[str, Any]) -> None:
    """A weight shared between modules (tied weights) would come apart: each module's
    parameters become DTensors registered anew, split or whole."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module_name)
    for names in owners.values():
        if len(names) > 1:
            raise ConflictError(f"tensor_parallel(): {' and '.join(names)} share a weight (tied "
                                "weights); splitting makes each module's parameters anew, which "
                                "would untie them silently; untie them (e.g. "
                                "tie_word_embeddings=False)")


def torch_style(module: nn.Module, style: Any) -> Any:
    """torch's ``ParallelStyle`` for a style name (a torch style is returned as is)."""
    if not isinstance(style, str):
        return style
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind, gathered, replicated_input = STYLES[style]
    if kind == "replicated":  # torch's sequence-parallel style: weights Replicate, the input
        # taken as this rank's shard (of rows: any dimension but the normalised last one),
        # so the weights' gradient is a partial sum, all-reduced by DTensor
        from torch.distributed.tensor.parallel import SequenceParallel

        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if kind == "colwise":
        return ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
    # an embedding's input (token ids) is whole on every rank
    if replicated_input or isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate())
    return RowwiseParallel()


def local_shapes(model: nn.Module, chosen: Mapping[str, Any], size: int
                ) -> dict[int, tuple[int, ...]]:
    """``id(parameter)`` -> the shape one rank holds of each parameter the plan splits."""
    modules = dict(model.named_modules())
    shapes: dict[int, tuple[int, ...]] = {}
    for name, style in chosen.items():
        module = modules[name]
        for param_name, dim in split_dims(module, style).items():
            param = getattr(module, param_name, None)
            if param is None or dim is None:
                continue
            shape = list(param.shape)
            shape[dim] = math.ceil(shape[dim] / size)
            shapes[id(param)] = tuple(shape)
    return shapes
