# JSON that keeps what a scheduler's state holds beyond JSON: integer keys and Counters.
"""A scheduler's ``state_dict()`` may hold dictionaries with integer keys (``MultiStepLR``'s
milestones, a ``Counter``), which plain JSON turns into strings: loaded back, the schedule
silently stops. :func:`encode` writes such a mapping as ``{"__keys__": [[key, value], ...]}``
(with ``"__counter__": true`` for a ``Counter``); :func:`decode` turns it back. Everything
else is plain JSON and comes back as it was; a state written before this encoding decodes
to itself."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["encode", "decode"]

_KEYS, _COUNTER = "__keys__", "__counter__"


def encode(value: Any) -> Any:
    """``value`` with every mapping whose keys are not all strings (or that is a Counter)
    written as a list of pairs."""
    if isinstance(value, dict):
        if isinstance(value, Counter) or not all(isinstance(k, str) for k in value):
            return {_KEYS: [[encode(k), encode(v)] for k, v in value.items()],
                    _COUNTER: isinstance(value, Counter)}
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """What :func:`encode` wrote, as it was (lists stay lists)."""
    if isinstance(value, dict):
        if set(value) == {_KEYS, _COUNTER} and isinstance(value[_KEYS], list):
            pairs = {_hashable(decode(k)): decode(v) for k, v in value[_KEYS]}
            return Counter(pairs) if value[_COUNTER] else pairs
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
