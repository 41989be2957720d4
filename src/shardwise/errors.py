# The exception types shardwise raises for mistakes a user can make.
"""Exception types.

Each subclasses ``ValueError`` or ``TypeError`` so that plain ``except ValueError``
keeps working; catch :class:`ShardwiseError` to catch every one of them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ShardwiseError",
    "ArgumentError",
    "EnvError",
    "ConflictError",
    "PrecisionError",
    "OptimizerError",
    "LossError",
    "NonFiniteError",
    "DataError",
    "RankFailedError",
    "CollectiveError",
    "PolicyError",
    "CheckpointError",
    "ConfigError",
    "FaultToleranceError",
]


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on purpose.

    ``origin`` names the config (a file, ``"training arguments"``) the error is about, when
    it is about one and its message already says so; None otherwise. Callers that add where
    an error came from ask it instead of reading the message.
    """

    origin: str | None = None


class ArgumentError(ShardwiseError, TypeError, ValueError):
    """An argument to a shardwise function or transform has the wrong type or value.

    Both a ``TypeError`` and a ``ValueError``, so either ``except`` catches it.
    """


class EnvError(ShardwiseError, ValueError):
    """The launcher's environment variables or an override to ``detect()`` are wrong."""


class ConflictError(ShardwiseError, ValueError):
    """Two parts of a pipeline contradict each other, or a transform is applied twice."""


class PrecisionError(ShardwiseError, ValueError):
    """A precision was asked for that the device cannot do, or is not a known name."""


class OptimizerError(ShardwiseError, ValueError):
    """The optimizer cannot be re-bound to the distributed model."""


class LossError(ShardwiseError, TypeError):
    """The step could not find a loss in what the model or ``loss_fn`` returned."""


class NonFiniteError(ShardwiseError, ValueError):
    """A loss or gradient was NaN or infinite and ``on_nonfinite="raise"``.

    ``state``: the :class:`~shardwise.TrainState` to continue from if you catch the error
    (raised by ``step()``): the step that saw the value counted in ``skipped_steps``, its
    window closed, its check cleared (None when raised by ``sw.save``/``bundle.check``
    directly on a state you hold: that is where ``exc.state`` comes from too).
    """

    def __init__(self, message: str, state: Any = None) -> None:
        super().__init__(message)
        self.state = state


class DataError(ShardwiseError, ValueError):
    """A data loader cannot be distributed as it is."""


class RankFailedError(ShardwiseError, RuntimeError):
    """A rank started by :func:`shardwise.testing.run_distributed` failed or timed out."""


class CollectiveError(ShardwiseError, RuntimeError):
    """A collective failed (timed out, or a peer went away); names where, and which ranks
    did not report."""


class PolicyError(ShardwiseError, ValueError):
    """A module-selection policy selected nothing in the model."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint is missing, partial, corrupt, or does not fit the bundle."""


class FaultToleranceError(ShardwiseError, RuntimeError):
    """Fault tolerance across replica groups (torchft) cannot start or go on: the extra is
    missing, a setting is, or a peer's state does not fit."""


class ConfigError(ShardwiseError, ValueError):
    """A config file (Accelerate, DeepSpeed, FSDP) holds a key or value shardwise cannot take."""

    @classmethod
    def at(cls, origin: str, message: str) -> ConfigError:
        """The error ``"<origin>: <message>"``, carrying ``origin`` as data."""
        error = cls(f"{origin}: {message}")
        error.origin = origin
        return error
