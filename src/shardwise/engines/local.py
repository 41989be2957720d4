# LocalEngine: one process, no wrapper; also what shard() and replicate() leave in one process.
"""The one-process engine."""

from __future__ import annotations

import attrs

from shardwise.engines.base import Engine

__all__ = ["LocalEngine"]


@attrs.frozen
class LocalEngine(Engine):
    """One process: the model is the user's module and gradients are complete on this rank."""
