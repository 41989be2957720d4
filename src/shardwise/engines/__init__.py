# The distribution engines: what differs between one process, DDP and FSDP2, one module each.
"""Engines: the seam between the step, checkpoints, export and memory, and torch's wrappers.

A distribution transform puts one engine in the bundle (:attr:`shardwise.Bundle.engine`);
everything that depends on how the model is distributed asks it instead of testing the
model's type. A new engine is one module here plus its transform.
"""

from shardwise.engines.base import Engine, MemoryParts
from shardwise.engines.ddp import DDPEngine
from shardwise.engines.fsdp import FSDPEngine
from shardwise.engines.local import LocalEngine
from shardwise.engines.tp import TPEngine

__all__ = ["Engine", "MemoryParts", "LocalEngine", "DDPEngine", "FSDPEngine", "TPEngine"]
