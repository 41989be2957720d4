# deepspeed(): the model and optimizer handed to DeepSpeed's own engine, its config the one source of truth.
"""DeepSpeed's engine as a distribution transform (optional: ``pip install 'shardwise[deepspeed]'``)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from shardwise._params import refuse_state
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.deepspeed_engine.launch_env import for_deepspeed_import, for_deepspeed_ranks
from shardwise.distributed import ensure_process_group
from shardwise.engines.base import Engine
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConfigError, ConflictError
from shardwise.plan import Plan
from shardwise.transforms.accumulation import AccumulateGradients
from shardwise.transforms.base import Distribution
from shardwise.transforms.clipping import ClipGradients
from shardwise.transforms.precision_policy import MixedPrecision

if TYPE_CHECKING:
    from shardwise.deepspeed_engine.auto import Given

__all__ = ["DeepSpeed", "deepspeed"]

EXTRA = "pip install 'shardwise[deepspeed]'"


def _config_value(value: Any) -> str | Mapping[str, Any]:
    if isinstance(value, os.PathLike):
        return str(value)
    if isinstance(value, str) or isinstance(value, Mapping):
        return value
    raise ArgumentError(f"deepspeed() 'config' must be a path to a DeepSpeed JSON or a mapping "
                        f"(got {type(value).__name__}: {short(value)})")


def import_deepspeed(env: Env) -> Any:
    """The ``deepspeed`` module (on a CPU env, DeepSpeed's CPU accelerator is chosen)."""
    for_deepspeed_import(env)
    try:
        import deepspeed  # noqa: PLC0415 (optional, and slow to import)
    except ImportError as exc:
        raise ArgumentError(f"deepspeed() needs the deepspeed package ({exc}): {EXTRA}") from None
    return deepspeed


def _layout(config: Mapping[str, Any], origin: str) -> tuple[int, tuple[str, ...]]:
    """The ZeRO stage and what is offloaded to the CPU, as the DeepSpeed reader reads them."""
    from shardwise._config_source import Source
    from shardwise.deepspeed_engine.settings import read, value

    said = read(Source(config, origin), native=False)
    offload = tuple(name for key, name in (("offload_optimizer", "optimizer"),
                                           ("offload_param", "parameters"))
                    if value(said, key, "none") != "none")
    return value(said, "stage", 0), offload


def _optional_positive(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ArgumentError(f"deepspeed() {attribute.name!r} must be a number > 0 or None "
                            f"(got {short(value)})")


def _optional_count(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ArgumentError(f"deepspeed() {attribute.name!r} must be an integer >= 1 or None "
                            f"(got {short(value)})")


def _optional_warmup(instance: Any, attribute: Any, value: Any) -> None:
    number = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value) and value >= 0
    if value is not None and not (number and (value < 1 or value == int(value))):
        raise ArgumentError(f"deepspeed() 'warmup' must be a count >= 0 or a fraction < 1 of "
                            f"the total (got {short(value)})")


def steps_per_epoch(loader: Any, world: int, accumulation: int) -> int | None:
    """Optimizer steps in one epoch of ``loader`` split over ``world`` ranks as
    ``DistributedSampler`` splits it (None: its length is unknown)."""
    dataset = getattr(loader, "dataset", None)
    size = getattr(loader, "batch_size", None)
    try:
        total = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not isinstance(size, int) or size < 1:
        return None
    drop = bool(getattr(loader, "drop_last", False))
    per_rank = total // world if drop else -(-total // world)
    batch = per_rank // size if drop else -(-per_rank // size)
    return max(1, -(-batch // accumulation))


def _join(env: Env) -> None:
    """The process group DeepSpeed runs over, and the variables it reads: torchrun's, set
    from ``env`` where another launcher (srun, mpirun) or none started the job; one process
    gets a group of its own."""
    import torch.distributed as dist

    for_deepspeed_ranks(env)
    if env.is_distributed:
        ensure_process_group(env)
    elif not dist.is_initialized():
        dist.init_process_group(env.backend, store=dist.HashStore(), rank=0, world_size=1)


@attrs.frozen(repr=False)
class DeepSpeed(Distribution):
    """Run the model and optimizer with DeepSpeed's engine (ZeRO 0-3, offload, its optimizers).

    The DeepSpeed config is the one source of truth for what it covers: ``"auto"`` values
    (and keys it leaves out) take the pipeline's precision, accumulation and clipping, the
    loader's batch size and the optimizer's hyperparameters; a transform that says
    otherwise than the config is refused naming both. The optimizer you pass is DeepSpeed's
    client optimizer, unless the config has an ``optimizer`` block (then pass None, or the
    optimizer whose hyperparameters fill its ``"auto"`` values). ``bundle.step``,
    ``bundle.predict``, ``sw.fit``, ``sw.save``/``sw.load`` (DeepSpeed's own files, checked
    before DeepSpeed reads them) and ``sw.export`` drive it; DeepSpeed decides the
    accumulation boundaries. Needs ``pip install 'shardwise[deepspeed]'``.

    A scheduler block's ``"auto"`` ``total_num_steps`` is the run's optimizer steps, as the
    Trainer fills it: ``steps``, or ``epochs`` times the optimizer steps per epoch of the
    pipeline's loader (its batches per rank, split as ``DistributedSampler`` splits, over the
    accumulation, a partial window counted); ``"auto"`` ``warmup_num_steps`` is ``warmup``
    (steps, or a fraction < 1 of the total), at least 1 as DeepSpeed requires.

    Args:
        config: a path to a DeepSpeed JSON, or a mapping.
        epochs: the epochs the run trains (for the scheduler's ``"auto"`` total).
        steps: the optimizer steps the run trains (takes precedence over ``epochs``).
        warmup: warm-up steps, or a fraction < 1 of the total (for ``"auto"`` warm-up).

    Example:
        >>> bundle = sw.pipeline(sw.deepspeed("ds_config.json"))(model, optimizer, loader)
    """

    config: str | Mapping[str, Any] = attrs.field(converter=_config_value, hash=False)
    source: str | None = attrs.field(default=None, kw_only=True, eq=False)
    """Where a mapping came from (a config file it was built from), for messages."""
    epochs: float | None = attrs.field(default=None, kw_only=True, validator=_optional_positive)
    steps: int | None = attrs.field(default=None, kw_only=True, validator=_optional_count)
    warmup: float | None = attrs.field(default=None, kw_only=True, validator=_optional_warmup)
    factory_name: ClassVar[str] = "deepspeed"
    keeps_optimizer: ClassVar[str | None] = "always"
    #: the config, not a pipeline default, decides the precision
    decides_precision: ClassVar[bool] = True

    @property
    def origin(self) -> str:
        """The config's file, or where a mapping came from."""
        if isinstance(self.config, str):
            return self.config
        return self.source or "<deepspeed config mapping>"

    def _read(self) -> Mapping[str, Any]:
        from shardwise._config_source import load_source  # YAML and the readers, when used

        return load_source(self.config).data

    def excludes(self) -> dict[str, str]:
        return {"shard_optimizer": "DeepSpeed's ZeRO stages shard optimizer state: set "
                                   "zero_optimization.stage in the config",
                "offload": "set zero_optimization.offload_optimizer / offload_param in the "
                           "DeepSpeed config"}

    def check(self, env: Env) -> None:
        import_deepspeed(env)
        self._read()

    def engine(self, env: Env, plan: Plan) -> Engine:
        return self._engine(env)

    def _engine(self, env: Env, ds: Any = None) -> Engine:
        """The engine record, with DeepSpeed's engine ``ds`` once it is built."""
        from shardwise.deepspeed_engine.engine import DeepSpeedEngine

        stage, offload = _layout(self._read(), self.origin)
        return DeepSpeedEngine(stage=stage, world_size=env.world_size, offload=offload, ds=ds)

    def _given(self, plan: Plan) -> Given:
        from shardwise.deepspeed_engine.auto import Given

        found = {type(t): t for t in plan.applied}
        precision = found.get(MixedPrecision)
        steps = found.get(AccumulateGradients)
        clip = found.get(ClipGradients)
        if clip is not None and clip.norm_type != 2.0:
            raise ConflictError(f"{clip!r} and {self!r}: DeepSpeed clips the 2-norm; use "
                                "clip_gradients(max_norm) with norm_type=2.0")
        return Given(plan.precision, None if precision is None else repr(precision),
                     plan.accumulation_steps, None if steps is None else repr(steps),
                     plan.max_grad_norm, None if clip is None else repr(clip))

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, plan = bundle.env, bundle.plan
        deepspeed = import_deepspeed(env)
        if plan.on_nonfinite == "skip":
            raise ConflictError(f"{self!r} with on_nonfinite='skip': DeepSpeed skips only fp16 "
                                "overflows (its loss scaler); under fp32/bf16 a non-finite loss "
                                "raises. Use on_nonfinite='raise'")
        from shardwise.deepspeed_engine.auto import resolve

        read = self._read()
        own_optimizer = isinstance(read.get("optimizer"), Mapping)
        if bundle.optimizer is None and not own_optimizer:
            raise ArgumentError(f"{self.origin}: deepspeed() needs the optimizer (DeepSpeed's "
                                "client optimizer), or an optimizer block in the config")
        if own_optimizer and bundle.scheduler is not None:
            raise ConflictError(f"{self.origin} has an optimizer block, so DeepSpeed builds its "
                                "own optimizer, and a scheduler was passed to the pipeline call: "
                                "it would schedule the optimizer DeepSpeed does not use. Put a "
                                "scheduler block in the config, or drop the optimizer block")
        universal = read.get("checkpoint")
        if isinstance(universal, Mapping) and universal.get("load_universal"):
            raise ConfigError.at(self.origin, "checkpoint.load_universal is not supported: "
                              "sw.load reads DeepSpeed's own per-rank files (same world size)")
        refuse_state(bundle.optimizer)
        config, precision, steps = resolve(
            self._read(), self.origin, given=self._given(plan),
            micro=getattr(bundle.loader, "batch_size", None), world=env.world_size,
            model=bundle.model, optimizer=bundle.optimizer,
            schedule=lambda accumulation: self._schedule(bundle.loader, env, accumulation))
        if isinstance(config.get("scheduler"), Mapping) and bundle.scheduler is not None:
            raise ConflictError(f"{self.origin} has a scheduler block and a scheduler was passed "
                                "to the pipeline call: keep one")
        if not own_optimizer:
            config.setdefault("zero_allow_untested_optimizer", True)
            if "optimizer" in _layout(config, self.origin)[1]:  # the client optimizer: on the CPU
                config.setdefault("zero_force_ds_cpu_optimizer", False)
        _join(env)
        try:
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=bundle.model, optimizer=None if own_optimizer else bundle.optimizer,
                model_parameters=[p for p in bundle.model.parameters() if p.requires_grad]
                if own_optimizer else None, config=config, dist_init_required=False)
        except (ValueError, AssertionError) as exc:  # its config checks (pydantic, asserts)
            raise ConfigError.at(self.origin, f"DeepSpeed refused the config: "
                              f"{str(exc)[:1000]}") from exc

        plan = attrs.evolve(plan, precision=precision, accumulation_steps=steps,
                            max_grad_norm=None)
        return attrs.evolve(
            bundle, model=engine, plan=plan, scaler=None,
            optimizer=optimizer if own_optimizer else bundle.optimizer,
            scheduler=bundle.scheduler if scheduler is None else None,
            engine=self._engine(env, engine))

    def _schedule(self, loader: Any, env: Env, accumulation: int) -> tuple[int | None, int | None]:
        """The run's optimizer steps and warm-up steps (None: not known from the arguments
        and the loader)."""
        total = self.steps
        if total is None and self.epochs is not None:
            per_epoch = steps_per_epoch(loader, env.world_size, accumulation)
            total = None if per_epoch is None else math.ceil(self.epochs * per_epoch)
        warmup = self.warmup
        if warmup is not None and 0 < warmup < 1:
            warmup = None if total is None else math.ceil(warmup * total)
        return total, None if warmup is None else max(1, int(warmup))

    def describe(self, env: Env) -> str:
        where = Path(self.origin).name if isinstance(self.config, str) or self.source else \
            "a mapping"
        return (f"DeepSpeed's engine with the config {where} (its \"auto\" values from the "
                "pipeline, the loader and the optimizer)")


#: the public factory: the class itself
deepspeed = DeepSpeed
