# checkpoint_activations(): recompute selected blocks' activations in backward instead of storing them.
"""Activation checkpointing (non-reentrant ``torch.utils.checkpoint``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch.utils.checkpoint import checkpoint

from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.errors import ConflictError
from shardwise.policies import Policy, select
from shardwise.transforms._checks import to_policy
from shardwise.transforms.base import Stage, Transform

__all__ = ["CheckpointActivations", "checkpoint_activations"]

_MARK = "_shardwise_checkpointed"


#: the names a block takes a key/value cache by (Transformers' layers, across versions)
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` run under non-reentrant checkpointing. A key/value cache it would update
    is not passed (``use_cache=False``), as Transformers' own gradient checkpointing does:
    backward's recomputation would append the same keys a second time (a Transformers Llama
    given a padding mask failed in backward with mismatched sizes)."""
    if torch.is_grad_enabled():
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        for name in _CACHES:
            if kwargs.get(name) is not None:
                kwargs[name] = None
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@attrs.frozen(repr=False)
class CheckpointActivations(Transform):
    """Recompute the activations of selected blocks during backward instead of storing them.

    Applied before distribution (canonical order); works with ``shard``, ``replicate`` and
    one process. Only each block's ``forward`` is wrapped, so parameter names (and so
    checkpoints and exports) do not change. The module is changed in place.

    Args:
        policy: which blocks; default :func:`shardwise.auto`.

    Example:
        >>> pipe = sw.pipeline(sw.checkpoint_activations(sw.by_class("LlamaDecoderLayer")))
    """

    policy: Policy = attrs.field(default=None,
                                 converter=lambda value: to_policy(value, "checkpoint_activations"))
    stage: ClassVar[Stage] = Stage.SURGERY
    factory_name: ClassVar[str] = "checkpoint_activations"

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        for name, module in select(self.policy, bundle.model, user=repr(self)):
            if getattr(module, _MARK, False):
                raise ConflictError(f"{self!r}: {name} ({type(module).__name__}) is "
                                    "checkpointed already")
            # the instance's forward is replaced; the module tree and its names stay as they are
            module.forward = functools.partial(_checkpointed, module.forward)
            setattr(module, _MARK, True)
        return bundle

    def describe(self, env: Env) -> str:
        return (f"blocks chosen by {self.policy!r} recompute their activations in backward "
                "(torch.utils.checkpoint, non-reentrant); parameter names unchanged")


#: the public factory: the class itself, so its defaults are written once
checkpoint_activations = CheckpointActivations
