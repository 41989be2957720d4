# Policies: which submodules a transform (shard, checkpoint_activations) applies to.
"""Module-selection policies: :func:`auto`, :func:`by_class`, :func:`by_size`, or any callable.

A policy is called as ``policy(qualified_name, module) -> bool``; the root (name ``""``)
is never offered. Example:

    >>> sw.shard(sw.by_class("LlamaDecoderLayer"))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import attrs
from torch import nn

from shardwise._text import short
from shardwise.errors import ArgumentError, PolicyError

__all__ = [
    "Policy", "auto", "by_class", "by_size", "select", "candidate_blocks", "repeated_blocks",
    "check_policy", "root_only",
]

#: ``(qualified_name, module) -> bool``
Policy = Callable[[str, nn.Module], bool]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the model's outermost ``nn.ModuleList``s (its layer stacks).

    Lists nested inside a block (e.g. a mixture-of-experts layer's experts) are not
    outermost, so the blocks are the decoder layers, not the experts; an encoder and a
    decoder stack both count.
    """
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                found.extend((f"{path}.{i}", block) for i, block in child.named_children())
            else:
                visit(path, child)

    visit("", model)
    return found


def candidate_blocks(model: nn.Module) -> list[str]:
    """Class names of the model's repeated blocks (see :func:`repeated_blocks`), most common
    first."""
    counts = Counter(type(block).__name__ for _, block in repeated_blocks(model))
    return [name for name, _ in counts.most_common()]


@attrs.frozen
class _Auto:
    def __call__(self, name: str, module: nn.Module) -> bool:  # resolved per model by select()
        raise NotImplementedError

    def __repr__(self) -> str:
        return "auto()"


@attrs.frozen
class _ByClass:
    classes: tuple[str | type, ...]

    def __call__(self, name: str, module: nn.Module) -> bool:
        for cls in self.classes:
            if isinstance(cls, str) and type(module).__name__ == cls:
                return True
            if isinstance(cls, type) and isinstance(module, cls):
                return True
        return False

    def __repr__(self) -> str:
        shown = ", ".join(repr(c) if isinstance(c, str) else c.__name__ for c in self.classes)
        return f"by_class({shown})"


@attrs.frozen
class _Modules:
    """Exactly these modules (by identity): what auto() found in one model."""

    ids: frozenset[int]

    def __call__(self, name: str, module: nn.Module) -> bool:
        return id(module) in self.ids


@attrs.frozen
class _RootOnly:
    """No submodule: with shard(), one FSDP2 group for the whole model (NO_WRAP)."""

    def __call__(self, name: str, module: nn.Module) -> bool:
        return False

    def __repr__(self) -> str:
        return "root_only()"


def root_only() -> Policy:
    """Select no submodule: ``shard(root_only())`` shards the model as one group
    (Accelerate's ``NO_WRAP``); it gathers all parameters at once, so use it for small models."""
    return _RootOnly()


@attrs.frozen
class _BySize:
    min_params: int

    def __call__(self, name: str, module: nn.Module) -> bool:
        return sum(p.numel() for p in module.parameters()) >= self.min_params

    def __repr__(self) -> str:
        return f"by_size({self.min_params})"


def auto() -> Policy:
    """A Transformers model's ``_no_split_modules`` when present, else the children of its
    outermost ``nn.ModuleList``s: its layer stacks (decoder layers; encoder and decoder
    layers; never the experts inside a layer)."""
    return _Auto()


def by_class(*classes: str | type) -> Policy:
    """Modules of these classes; a string matches the class ``__name__`` ("LlamaDecoderLayer").

    Raises:
        TypeError: no class given, or something that is neither a string nor a class.
    """
    if not classes:
        raise ArgumentError("by_class() needs at least one class or class name")
    for cls in classes:
        if not isinstance(cls, (str, type)):
            raise ArgumentError(f"by_class() takes class names or classes (got {short(cls)})")
    return _ByClass(tuple(classes))


def by_size(min_params: int) -> Policy:
    """Modules holding at least ``min_params`` parameters not already in a selected submodule.

    Chosen bottom-up, like FSDP1's size-based auto-wrap policy; containers without a
    forward (``nn.ModuleList``, ``nn.ModuleDict``) are never chosen.

    Raises:
        ValueError: ``min_params`` is not a positive integer.
    """
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ArgumentError(f"by_size() 'min_params' must be an integer >= 1 (got {short(min_params)})")
    return _BySize(min_params)


def check_policy(policy: object, user: str) -> None:
    """Raise unless ``policy`` can be called as ``policy(name, module)``."""
    if not callable(policy):
        raise ArgumentError(f"{user}: a policy must be auto(), by_class(...), by_size(...) or a "
                            f"callable (name, module) -> bool (got {short(policy)}); for a class name "
                            f"write by_class({short(policy)})")


def _resolve(policy: Policy, model: nn.Module) -> Policy:
    if not isinstance(policy, _Auto):
        return policy
    names = getattr(model, "_no_split_modules", None)
    if names:
        return _ByClass(tuple(names))
    return _Modules(frozenset(id(block) for _, block in repeated_blocks(model)))


def _by_size(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        """Parameters under ``module`` that no chosen module holds yet."""
        rest = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            rest += visit(f"{name}.{child_name}" if name else child_name, child)
        containers = (nn.ModuleList, nn.ModuleDict)
        if name and rest >= min_params and not isinstance(module, containers):
            chosen.append((name, module))
            return 0
        return rest

    visit("", model)
    return chosen


def select(policy: Policy, model: nn.Module, *, user: str) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs ``policy`` selects in ``model``, children before parents.

    ``by_size`` counts only parameters no selected submodule holds, bottom-up.

    Raises:
        PolicyError: the policy selects nothing; the message lists the candidate block classes.
    """
    check_policy(policy, user)
    if isinstance(policy, _RootOnly):
        return []
    rule = _resolve(policy, model)
    if isinstance(rule, _BySize):
        chosen = _by_size(model, rule.min_params)
    else:
        chosen = [(n, m) for n, m in model.named_modules() if n and rule(n, m)]
    if not chosen:
        candidates = candidate_blocks(model)
        raise PolicyError(
            f"{user}: policy {short(policy)} selects no submodule of {type(model).__name__}; "
            f"candidate block classes: {candidates or 'none (the model has no nn.ModuleList)'}; "
            "name one with by_class(...)")
    chosen.sort(key=lambda item: item[0].count("."), reverse=True)  # deepest first
    return chosen
