# Experiment trackers for sw.fit: Weights & Biases, MLflow, trackio, and a registry of your own.
"""Trackers: loggers that start a run with its configuration.

A tracker is a :class:`~shardwise.loggers.Logger` (``log(metrics, step)``, ``close()``) with
``init(config)``, which ``sw.fit`` calls once on the main process before the first step with
the run's configuration (``fit(config=...)``; the TrainingArguments under
``sw.from_training_args``). Each adapter imports its package only when its run starts, so
building one costs nothing and a package that is missing is named when it is needed.
``report_to`` names (``"wandb"``, ``"mlflow"``, ``"trackio"``, ``"tensorboard"``, and
whatever :func:`register_tracker` adds) build them by name.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from shardwise._text import short
from shardwise.errors import ArgumentError
from shardwise.loggers import Logger, TensorBoardLogger

__all__ = ["MLflowTracker", "TrackioTracker", "WandbTracker", "names", "register_tracker", "tracker"]


def _package(name: str, tracker: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{tracker} needs the {name} package ({exc}); pip install "
                          f"{name.replace('_', '-')}, or drop it from report_to/loggers") from None


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as JSON-friendly values (anything else by its text)."""
    return json.loads(json.dumps(dict(config), default=str))


class _Tracker:
    """What the three adapters share: the run (None until :meth:`init`), the configuration
    ``report_to`` gave, and ``log``/``close`` around each package's own calls."""

    def __init__(self, run_name: str | None) -> None:
        self.run_name = run_name
        self.run: Any = None
        self.config: dict[str, Any] = {}  # recorded with fit's config= (report_to sets it)

    def init(self, config: Mapping[str, Any]) -> None:
        """Start the run with ``config`` as its configuration."""
        self.run = self._start(_plain(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` (the run starts here if ``init`` was not called)."""
        if self.run is None:
            self.init({})
        self._log({k: float(v) for k, v in metrics.items()}, step)

    def close(self) -> None:
        """End the run, if one started."""
        if self.run is not None:
            self._finish()
            self.run = None

    def _start(self, config: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class WandbTracker(_Tracker):
    """Weights & Biases: ``wandb.init(project, name, config)``, ``run.log(metrics,
    step=step)``, ``run.finish()``. ``options`` go to ``wandb.init`` (``mode="offline"``,
    ``dir=...``, ``entity=...``).

    Example:
        >>> sw.fit(bundle, steps=1000, loggers=[sw.WandbTracker("my-project")], config=hparams)
    """

    def __init__(self, project: str | None = None, run_name: str | None = None,
                 **options: Any) -> None:
        super().__init__(run_name)
        self.project, self.options = project, options

    def __repr__(self) -> str:
        return f"WandbTracker({self.project!r})"

    def _start(self, config: dict[str, Any]) -> Any:
        wandb = _package("wandb", "WandbTracker")
        return wandb.init(project=self.project, name=self.run_name, config=config,
                          **self.options)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def _finish(self) -> None:
        self.run.finish()


class MLflowTracker(_Tracker):
    """MLflow: a run in ``experiment`` (at ``tracking_uri``, e.g. ``file:./mlruns``), the
    configuration as parameters (100 per call, values cut at 500 characters, as MLflow limits
    them), metrics at their step, the run ended at close.

    Example:
        >>> sw.fit(bundle, steps=1000, loggers=[sw.MLflowTracker("exp1")], config=hparams)
    """

    def __init__(self, experiment: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None) -> None:
        super().__init__(run_name)
        self.experiment, self.tracking_uri = experiment, tracking_uri

    def __repr__(self) -> str:
        return f"MLflowTracker({self.experiment!r})"

    def _start(self, config: dict[str, Any]) -> Any:
        mlflow = _package("mlflow", "MLflowTracker")
        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.experiment is not None:
            mlflow.set_experiment(self.experiment)
        run = mlflow.start_run(run_name=self.run_name)
        params = [(k, str(v)[:500]) for k, v in config.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 per call
            mlflow.log_params(dict(params[start:start + 100]))
        return run

    def _log(self, metrics: dict[str, float], step: int) -> None:
        _package("mlflow", "MLflowTracker").log_metrics(metrics, step=step)

    def _finish(self) -> None:
        _package("mlflow", "MLflowTracker").end_run()


class TrackioTracker(_Tracker):
    """trackio (Hugging Face's local-first tracker): ``trackio.init(project, name, config)``,
    ``trackio.log(metrics, step=step)``, ``trackio.finish()``. ``options`` go to
    ``trackio.init``.

    Example:
        >>> sw.fit(bundle, steps=1000, loggers=[sw.TrackioTracker("my-project")], config=hparams)
    """

    def __init__(self, project: str = "shardwise", run_name: str | None = None,
                 **options: Any) -> None:
        super().__init__(run_name)
        self.project, self.options = project, options

    def __repr__(self) -> str:
        return f"TrackioTracker({self.project!r})"

    def _start(self, config: dict[str, Any]) -> Any:
        trackio = _package("trackio", "TrackioTracker")
        return trackio.init(project=self.project, name=self.run_name, config=config,
                            **self.options)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        _package("trackio", "TrackioTracker").log(metrics, step=step)

    def _finish(self) -> None:
        _package("trackio", "TrackioTracker").finish()


class _Registry:
    """The trackers ``report_to`` can name: each name and what builds one from the run's
    output directory."""

    def __init__(self) -> None:
        self.factories: dict[str, Callable[[str], Logger]] = {
            "tensorboard": lambda output: TensorBoardLogger(f"{output}/runs"),
            "wandb": lambda output: WandbTracker(),
            "mlflow": lambda output: MLflowTracker(),
            "trackio": lambda output: TrackioTracker(),
        }


_REGISTRY = _Registry()


def register_tracker(name: str, factory: Callable[[str], Logger]) -> None:
    """Let ``report_to`` name your own tracker: ``factory(output_dir)`` returns a logger
    (``log``, ``close``, and ``init(config)`` if it records a configuration).

    Raises:
        ArgumentError: ``name`` is not a non-empty string or is ``"none"``/``"all"``, or
            ``factory`` is not callable.

    Example:
        >>> sw.register_tracker("comet", lambda output: CometTracker(output))
    """
    if not isinstance(name, str) or not name or name in ("none", "all"):
        raise ArgumentError(f"register_tracker() 'name' must be a non-empty string other than "
                            f"'none' and 'all' (got {short(name)})")
    if not callable(factory):
        raise ArgumentError(f"register_tracker() 'factory' must be a callable output_dir -> "
                            f"logger (got {short(factory)})")
    _REGISTRY.factories[name] = factory


def tracker(name: str, output_dir: str = ".") -> Logger:
    """The tracker ``report_to`` names ``name``, for a run writing under ``output_dir``.

    Raises:
        ArgumentError: no tracker of that name (the accepted names are listed).
    """
    factory = _REGISTRY.factories.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ArgumentError(f"no tracker named {short(name)}; accepted: "
                            f"{', '.join(sorted(_REGISTRY.factories))} (register_tracker adds one)")
    return factory(output_dir)


def names() -> list[str]:
    """Every tracker name ``report_to`` accepts."""
    return sorted(_REGISTRY.factories)
