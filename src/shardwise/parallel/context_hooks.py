# Where context_parallel reaches a model's attention: Transformers' registry, or a declared attribute.
"""How ``context_parallel`` puts its exchange around a model's attention, model code unchanged.

- A Transformers model: shardwise registers one attention function in Transformers'
  ``AttentionInterface`` and points the model's config at it. It runs the model's own
  implementation (``sdpa`` for ``eager``, which it equals) on whole sequences, causal, between
  the two all-to-alls of :func:`shardwise.parallel.ulysses.ulysses_attention`.
- Any other model declares ``self.context_parallel = None`` on its attention modules and calls
  ``self.context_parallel.attend(q, k, v, attend)`` when it is set; the transform sets it to
  the rank's :class:`~shardwise.parallel.context_split.ContextSplit`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConflictError
from shardwise.parallel.context_split import REGISTRY_NAME, ContextSplit

__all__ = ["hook_attention", "ATTRIBUTE"]

#: the attribute an attention module outside Transformers declares (None) to be hooked
ATTRIBUTE = "context_parallel"
#: where a hooked Transformers module keeps (split, the implementation it ran before)
_SLOT = "_shardwise_context"
#: the implementations that take is_causal=True with no mask as causal attention (flex
#: attention would run bidirectionally without its block mask)
CAUSAL_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


class _Heads:
    """A module seen with another ``num_key_value_groups`` (the query heads per key/value
    head of this rank's slice of the heads); every other attribute is the module's."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _registered_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, **kwargs: Any
                          ) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: ``[B, H, slice, D]`` in, ``[B, slice, H, D]``
    out, computed over whole sequences."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hooked = module.__dict__.get(_SLOT)
    if hooked is None:
        raise ConflictError(f"{type(module).__name__} runs shardwise's context-parallel "
                            "attention but was not hooked by sw.context_parallel; load the model "
                            "again, or apply context_parallel to it")
    split, implementation = hooked
    inner = ALL_ATTENTION_FUNCTIONS[implementation]
    kwargs.pop("is_causal", None)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen = _Heads(module, q.shape[1] // k.shape[1])
        out, _ = inner(seen, q, k, v, None, is_causal=True, **kwargs)
        return out.transpose(1, 2)

    window = kwargs.get("sliding_window")
    if isinstance(window, int) and query.shape[2] * split.size > window:
        raise ConflictError(f"context_parallel attends causally over whole sequences; this "
                            f"layer has a sliding window of {window} tokens, shorter than the "
                            f"sequence ({query.shape[2] * split.size}): not supported")
    whole = split.attend(query, key, value, attend)
    return whole.transpose(1, 2).contiguous(), None


def _transformers_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    return config if isinstance(model, PreTrainedModel) else None


def _check_causal(model: nn.Module, config: Any) -> None:
    """Refuse a model whose attention is not causal everywhere (an encoder, an
    encoder-decoder, a vision tower beside a language model): its labels are not next tokens
    and its attention would be made causal."""
    if getattr(config, "is_encoder_decoder", False):
        raise ConflictError(f"context_parallel splits causal language models; "
                            f"{type(model).__name__} is an encoder-decoder")
    flags = {name: module.is_causal for name, module in model.named_modules()
             if isinstance(getattr(module, "is_causal", None), bool)}
    bidirectional = [name for name, causal in flags.items() if not causal]
    if not flags or bidirectional:
        where = f" ({bidirectional[0]} is not causal)" if bidirectional else ""
        raise ConflictError(f"context_parallel splits causal language models, whose attention "
                            f"is causal in every layer; {type(model).__name__}'s is not{where}")


def hook_attention(model: nn.Module, split: ContextSplit, tp: int = 1) -> str:
    """Put ``split``'s exchange around every attention of ``model``; say how, in words.
    ``tp``: the tensor-parallel group's size (each rank holds 1/tp of the heads).

    Raises:
        ConflictError: a Transformers model whose attention is not a registry function, or
            another model with no module declaring ``context_parallel``.
    """
    config = _transformers_config(model)
    if config is not None:
        _check_causal(model, config)
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int) and heads % (split.size * tp):
            beside = f" x tensor_parallel(size={tp})" if tp > 1 else ""
            raise ConflictError(f"context_parallel(size={split.size}, method='ulysses'){beside} "
                                f"gives each rank 1/{split.size * tp} of the attention heads, and "
                                f"this model has {heads}; use sizes whose product divides {heads}")
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        before = config._attn_implementation
        if before == REGISTRY_NAME:
            raise ConflictError("this model's attention is hooked for context parallelism "
                                "already; pass a model context_parallel was not applied to")
        if before in (None, "eager") and not getattr(model, "_supports_sdpa", True):
            raise ConflictError(f"context_parallel runs 'eager' attention as 'sdpa', which "
                                f"{type(model).__name__} does not support (its eager attention "
                                "differs); not supported for this model")
        implementation = "sdpa" if before in (None, "eager") else before
        if implementation not in CAUSAL_KERNELS or implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ConflictError(f"context_parallel runs the model's attention on whole sequences "
                                f"with is_causal=True and no mask, which {before!r} does not "
                                f"honour; use attn_implementation= one of 'eager', "
                                f"{', '.join(repr(k) for k in CAUSAL_KERNELS)}")
        AttentionInterface.register(REGISTRY_NAME, _registered_attention)
        for module in model.modules():  # sub-models (a text_config's) run it too
            if getattr(module, "config", None) is not None:
                module.__dict__[_SLOT] = (split, implementation)
        config._attn_implementation = REGISTRY_NAME
        return (f"Transformers' attention registry: {implementation!r} on whole sequences "
                f"between two all-to-alls")
    hooked = [name for name, module in model.named_modules() if hasattr(module, ATTRIBUTE)]
    if not hooked:
        raise ConflictError(f"context_parallel cannot reach the attention of "
                            f"{type(model).__name__}: it is not a Transformers model, and no "
                            f"module declares '{ATTRIBUTE}' (set self.{ATTRIBUTE} = None in "
                            f"your attention module and call self.{ATTRIBUTE}.attend(q, k, v, "
                            "attend) when it is set)")
    for name, module in model.named_modules():
        if name in hooked:
            setattr(module, ATTRIBUTE, split)
    return f"{len(hooked)} module(s) declaring '{ATTRIBUTE}'"
