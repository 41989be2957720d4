# pipeline() and from_config / from_ddp_args / from_training_args: every entry point that builds a Pipeline.
"""Building pipelines: :func:`pipeline` from code (and the config a launcher hands over),
the others from the config files and arguments users already have. The readers in
:mod:`shardwise.configs` say what a config means; :func:`shardwise.pipelines.assemble`
builds the pipeline, which knows nothing of config formats.

Example:
    >>> pipe = sw.from_config("default_config.yaml")
    >>> print(pipe.explain())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from shardwise._config_source import load_source, say
from shardwise._text import short
from shardwise.configs import (
    ConfigResult,
    config_env_settings,
    config_kind,
    ddp_settings,
    read_config,
)
from shardwise.configs.distributed_config import as_mapping
from shardwise.configs.training_args import (
    TrainingSettings,
    for_fit,
    for_trainer,
    read_training_args,
    training_env_settings,
)
from shardwise.deepspeed_engine.config_file import engine_config
from shardwise.deepspeed_engine.transform import deepspeed
from shardwise.env import Env, given_or_detected
from shardwise.errors import ArgumentError, ConfigError, ConflictError, ShardwiseError
from shardwise.pipelines import Pipeline, assemble
from shardwise.state import OnNonFinite, check_on_nonfinite
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.data_distribution import DistributeData
from shardwise.transforms.offloading import Offload
from shardwise.transforms.precision_policy import MixedPrecision
from shardwise.transforms.replication import Replicate

__all__ = ["pipeline", "from_config", "from_ddp_args", "from_training_args"]


def pipeline(*parts: Env | Transform, on_nonfinite: OnNonFinite = "raise") -> Pipeline:
    """Build a pipeline from at most one :class:`Env` and any transforms, in any order.

    Transforms are sorted into the canonical stages (settings, surgery, distribution,
    placement, data). What the env needs and the parts do not say is chosen by default:
    ``replicate()`` for several processes, bf16 on CUDA devices that compute it natively
    (else fp32), placement, and data distribution when a loader is passed.

    When the env's ``config_path`` is set (``shardwise launch --config_file``, or
    ``$SHARDWISE_CONFIG_FILE``), the config file's transforms (:func:`shardwise.from_config`)
    are added, except those the code gives itself (same kind, or another distribution).
    Started by ``accelerate launch``, the settings it hands over in ``ACCELERATE_*`` /
    ``FSDP_*`` variables (``Env.accelerate_variables``) are read the same way, as the
    Accelerate config they came from.

    Args:
        *parts: an optional :class:`Env` (else :func:`detect` is called) and transforms.
        on_nonfinite: ``"raise"`` or ``"skip"`` on a non-finite loss/gradient in fp32/bf16.

    Raises:
        ConflictError: two Envs, a transform given twice, two distribution transforms.
        PrecisionError: a precision the env's device cannot do.
        TypeError: a part that is neither an Env nor a transform.

    Example:
        >>> bundle = sw.pipeline(sw.detect())(model, optimizer, loader)
    """
    envs = [p for p in parts if isinstance(p, Env)]
    transforms = [p for p in parts if isinstance(p, Transform)]
    for part in parts:
        if not isinstance(part, (Env, Transform)):
            raise ArgumentError(f"pipeline() takes an Env and transforms (got {short(part)} of type "
                                f"{type(part).__name__}); build transforms with sw.replicate(), ...")
    if len(envs) > 1:
        raise ConflictError(f"pipeline() got {len(envs)} Envs ({envs[0]!r} and {envs[1]!r}); "
                            "pass one")
    check_on_nonfinite(on_nonfinite, "pipeline()")
    env = envs[0] if envs else given_or_detected(None)
    if not (env.config_path or env.accelerate_variables):
        return assemble(env, transforms, None, on_nonfinite=on_nonfinite)
    # the Accelerate variables' reader (and YAML) is imported only when there is one to read
    from shardwise.configs.accelerate_env import (
        ORIGIN,
        launched_by_accelerate,
        read_accelerate_variables,
    )

    if env.config_path:
        note = (f"config {env.config_path} applied; transforms given in code take precedence "
                "over it")
        if launched_by_accelerate(env):
            note += f"; {ORIGIN} are not applied (the config file is)"
        return _configured(env, transforms, read_config(env.config_path, env=env),
                           str(env.config_path), on_nonfinite=on_nonfinite,
                           reason=f"from config {env.config_path}", notes=(note,))
    if launched_by_accelerate(env):
        found, notices = read_accelerate_variables(env)
        shown = ", ".join(f"{k}={v if len(v) <= 60 else v[:57] + '...'}"
                          for k, v in env.accelerate_variables)
        note = f"{ORIGIN} applied ({shown}); transforms given in code take precedence over them"
        config = ConfigResult(tuple(found), tuple(notices), ORIGIN, "accelerate", env)
        return _configured(env, transforms, config, f"{ORIGIN} ({shown})",
                           on_nonfinite=on_nonfinite, reason=f"from {ORIGIN}", notes=(note,))
    return assemble(env, transforms, None, on_nonfinite=on_nonfinite)


def _configured(env: Env, transforms: list[Transform], config: ConfigResult, origin: str, *,
                on_nonfinite: OnNonFinite, reason: str, notes: tuple[str, ...]) -> Pipeline:
    """:func:`assemble` with a config; what the env refuses of it names where it came from."""
    try:
        return assemble(env, transforms, config, on_nonfinite=on_nonfinite, reason=reason,
                        notes=notes)
    except ShardwiseError as exc:
        if exc.origin is not None or not config.transforms:  # it says where already
            raise
        raise ConfigError.at(origin, f"{exc}") from exc


def from_config(source: str | Path | Mapping[str, Any] | Any, *, env: Env | None = None,
                engine: str = "native") -> Pipeline:
    """A pipeline from an Accelerate YAML, a DeepSpeed JSON, a Transformers ``fsdp_config``
    or a Transformers ``DistributedConfig`` (``pp_size``, ``tp_size``, ``fsdp_size``, ...).

    The format is recognised from the content. Every key maps to a transform, is refused, or
    gives one notice (a key with no meaning here: logged, and listed by ``explain()``).

    Args:
        source: a path (YAML or JSON), a mapping, or a ``DistributedConfig``.
        env: the env; by default :func:`shardwise.detect` (``use_cpu: true`` forces the CPU).
        engine: for a DeepSpeed config (a JSON, or an Accelerate YAML with
            ``distributed_type: DEEPSPEED``): ``"native"`` (the default) maps it onto
            PyTorch's DDP/FSDP2, ``"deepspeed"`` runs DeepSpeed's own engine
            (:func:`shardwise.deepspeed`, needs ``shardwise[deepspeed]``).

    Raises:
        ConfigError: unknown keys, wrong types or shapes, impossible or contradictory values
            (naming the file, the key, a short excerpt of the value and what is accepted),
            or transforms the env cannot run (``fp16`` on a CPU, ...), naming the file.

    Example:
        >>> pipe = sw.from_config("ds_config.json")
        >>> pipe = sw.from_config(DistributedConfig(pp_size=2, tp_size=2))  # transformers
    """
    if engine not in ("native", "deepspeed"):
        raise ArgumentError(f"from_config() 'engine' must be 'native' or 'deepspeed' (got "
                            f"{short(engine)})")
    source = as_mapping(source)  # a Transformers DistributedConfig: its fields
    if engine == "deepspeed":
        return _deepspeed_engine(source, env)
    config = read_config(source, env=_env_for(source, env))
    notes = (f"{config.origin} is a DeepSpeed config: mapped onto native PyTorch sharding "
             "(the default engine); sw.from_config(..., engine=\"deepspeed\") runs DeepSpeed's "
             "own engine",) if config.deepspeed else ()
    try:
        return assemble(config.env, [], config, notes=notes)
    except ShardwiseError as exc:  # what the config asks for, refused by this env
        if exc.origin is not None:  # it says where already
            raise
        raise ConfigError.at(config.origin, f"{exc}") from exc


def from_ddp_args(*, ddp_backend: str | None = None,
                  ddp_find_unused_parameters: bool | None = None,
                  ddp_bucket_cap_mb: float | None = None, ddp_timeout: float | None = None,
                  ddp_broadcast_buffers: bool | None = None, env: Env | None = None) -> Pipeline:
    """A ``replicate()`` pipeline from Transformers' ``TrainingArguments`` DDP settings.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the argument.

    Example:
        >>> pipe = sw.from_ddp_args(ddp_bucket_cap_mb=50, ddp_timeout=7200)
    """
    overrides, replicated = ddp_settings(
        ddp_backend=ddp_backend, ddp_find_unused_parameters=ddp_find_unused_parameters,
        ddp_bucket_cap_mb=ddp_bucket_cap_mb, ddp_timeout=ddp_timeout,
        ddp_broadcast_buffers=ddp_broadcast_buffers)
    return assemble(given_or_detected(env, **overrides), [replicated], None)


def from_training_args(args: Any, *, env: Env | None = None, engine: str = "native") -> Pipeline:
    """A pipeline from Transformers' ``TrainingArguments`` (or a mapping of its field names,
    so Transformers stays optional), with the ``sw.fit`` settings they give.

    ``fsdp``/``fsdp_config``, ``deepspeed``, ``ddp_*``, ``bf16``/``fp16`` (neither: fp32,
    as the Trainer), ``gradient_accumulation_steps``, ``max_grad_norm`` (default 1.0),
    ``activation_checkpointing``, ``dataloader_pin_memory``, ``accelerator_config``,
    ``seed``/``data_seed`` and ``use_cpu`` become transforms and env settings; the loop
    settings (``num_train_epochs``, ``max_steps``, ``logging_steps``, ``save_steps``,
    ``save_total_limit``, ``eval_steps``, ``output_dir``, ``disable_tqdm``, ``report_to``)
    become ``pipe.fit_options``. A mapping's missing names take ``TrainingArguments``'
    defaults. Every other argument gives one notice when set (``explain()`` lists them), or
    is refused; docs/training-args.md has the table. ``engine="deepspeed"`` runs the
    ``deepspeed`` config with DeepSpeed's own engine (:func:`shardwise.deepspeed`) instead
    of mapping it onto PyTorch's.

    Raises:
        ConfigError: an unknown name, a wrong value, an argument with no counterpart that
            would change results, or a contradiction (with a DeepSpeed file it names too),
            naming the argument(s).

    Example:
        >>> pipe = sw.from_training_args({"bf16": True, "gradient_accumulation_steps": 4,
        ...                               "max_steps": 1000, "output_dir": "out"})
        >>> bundle = pipe(model, optimizer, loader)
        >>> state = sw.fit(bundle, **pipe.fit_options)
    """
    if engine not in ("native", "deepspeed"):
        raise ArgumentError(f"from_training_args() 'engine' must be 'native' or 'deepspeed' "
                            f"(got {short(engine)})")
    env = given_or_detected(env, **training_env_settings(args))
    settings = for_fit(read_training_args(args, env, engine), args, env)
    say(settings.notices)
    return _training_pipeline(settings, env, settings.transforms, settings.notices)


def trainer_pipeline(args: Any) -> Pipeline:
    """The pipeline a Trainer on shardwise runs: what ``from_training_args(args)`` gives,
    without the ``sw.fit`` options and without notices for the fields the Trainer applies
    itself (its optimizer, scheduler, loaders, evaluation, logging, checkpoints, Hub).

    Started by ``accelerate launch``, the launch config fills in what the arguments leave
    out, as the Trainer on Accelerate takes it: its distribution (FSDP, DeepSpeed mapped
    natively, a mesh) where ``fsdp``, ``deepspeed`` and ``parallelism_config`` are unset,
    and its mixed precision where neither ``bf16`` nor ``fp16`` is set.
    """
    env = given_or_detected(None, **training_env_settings(args))
    settings = for_trainer(read_training_args(args, env))
    say(settings.notices)
    transforms, notices = list(settings.transforms), list(settings.notices)
    from shardwise.configs.accelerate_env import launched_by_accelerate, read_accelerate_variables

    if launched_by_accelerate(env):
        launched, more = read_accelerate_variables(env)
        transforms = _with_launch(args, transforms, launched)
        notices += more
    # the Trainer's loaders are split as Accelerate splits them, drawing their seeds from
    # torch's global stream as Accelerate's do: said here, so explain() says what runs
    transforms = [attrs.evolve(t, split="batches", global_seed=True)
                  if isinstance(t, DistributeData) else t for t in transforms]
    return _training_pipeline(settings, env, transforms, notices)


#: the launch config's distribution: the transforms that shard, split or replicate the model
_DISTRIBUTION = (Stage.EXPERT_PARALLEL, Stage.TENSOR_PARALLEL, Stage.DISTRIBUTION)


def _with_launch(args: Any, own: list[Transform], launched: list[Transform]) -> list[Transform]:
    """``own`` (the arguments') with what ``accelerate launch`` says where they are silent."""
    def said(name: str) -> bool:
        return bool(getattr(args, name, None) if not isinstance(args, Mapping)
                    else args.get(name))

    out = list(own)
    distribution = [t for t in launched if t.stage in _DISTRIBUTION or isinstance(t, Offload)]
    if distribution and not any(said(n) for n in ("fsdp", "deepspeed", "parallelism_config")) \
            and any(t.stage == Stage.DISTRIBUTION and not isinstance(t, Replicate)
                    for t in distribution):
        out = [t for t in out if t.stage not in _DISTRIBUTION] + distribution
        out += [t for t in launched if t.stage == Stage.SURGERY
                and not any(o.stage == Stage.SURGERY for o in own)]  # FSDP's checkpointing
    precision: list[Transform] = [t for t in launched if isinstance(t, MixedPrecision)]
    if precision and not (said("bf16") or said("fp16")):
        out = [t for t in out if not isinstance(t, MixedPrecision)] + precision
    return out


def _training_pipeline(settings: TrainingSettings, env: Env, transforms: Sequence[Transform],
                       notices: Sequence[str]) -> Pipeline:
    """The pipeline of what TrainingArguments mean under ``env``; a refusal that does not
    say where it came from names the arguments."""
    config = ConfigResult(tuple(transforms), (*notices, *settings.notes), settings.origin,
                          "training arguments", env)
    try:
        return assemble(env, [], config, reason=f"from {settings.origin}",
                        fit_options=settings.fit_options)
    except ShardwiseError as exc:
        if exc.origin is not None:  # it says where already
            raise
        raise ConfigError.at(settings.origin, f"{exc}") from exc


def _env_for(source: Any, env: Env | None) -> Env:
    """The Env given, else the one :func:`detect` makes with what the config says of it."""
    return env if env is not None else given_or_detected(None, **config_env_settings(source))


def _deepspeed_engine(source: str | Path | Mapping[str, Any], env: Env | None) -> Pipeline:
    """``from_config(source, engine="deepspeed")``: one ``deepspeed()`` transform."""
    src = load_source(source)
    kind = config_kind(src)
    notices: tuple[str, ...] = ()
    if kind == "accelerate":  # its keys checked, its block against the file it names
        checked = read_config(source, env=_env_for(source, env))
        env, notices = checked.env, checked.notices
    env = _env_for(source, env)
    transform = deepspeed(engine_config(source, kind), source=src.origin)
    config = ConfigResult((transform,), notices, src.origin, kind, env, True)
    return assemble(env, [], config, reason=f"from {kind} config {src.origin}: DeepSpeed's own "
                    "engine (engine=\"deepspeed\")")
