# Loggers for sw.fit: a two-method protocol, and TensorBoard built in.
"""Where ``sw.fit`` sends its metrics besides Python logging.

Any object with ``log(metrics, step)`` and ``close()`` is a logger; ``fit`` calls them on the
main process only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["Logger", "TensorBoardLogger"]


@runtime_checkable
class Logger(Protocol):
    """What ``sw.fit(loggers=...)`` calls: ``log`` every ``log_every`` steps and after each
    evaluation, ``close`` once at the end."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release whatever the logger holds."""


class TensorBoardLogger:
    """Scalars to TensorBoard through ``torch.utils.tensorboard`` (needs ``tensorboard``).

    The event file is opened at the first :meth:`log`, so a logger built on every rank
    writes (and creates ``log_dir``) only where it is used: ``sw.fit`` logs on the main
    process.

    Example:
        >>> sw.fit(bundle, steps=1000, loggers=[sw.TensorBoardLogger("runs/exp1")])
    """

    def __init__(self, log_dir: str = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"TensorBoardLogger needs the tensorboard package ({exc}); "
                              "pip install tensorboard, or pass another logger") from None
        self.log_dir = log_dir
        self._open: Any = SummaryWriter
        self._writer: Any = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger({self.log_dir!r})"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write each metric as a scalar at ``step`` (the event file is opened on first use)."""
        if self._writer is None:
            self._writer = self._open(log_dir=self.log_dir)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        """Flush and close the event file, if one was opened."""
        if self._writer is not None:
            self._writer.close()
