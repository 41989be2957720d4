# pipeline(): sorts transforms into the canonical order, refuses contradictions, picks defaults.
"""The pipeline: the only combinator of transforms."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from shardwise import precision
from shardwise._params import refuse_state
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.choice import SAFE_FRACTION, choose_distribution, sample_batch
from shardwise.device_skip import fused_kernel_choice, use_fused_kernel
from shardwise.distributed import ensure_process_group
from shardwise.env import Env, detect
from shardwise.errors import ArgumentError, ConfigError, ConflictError, ShardwiseError
from shardwise.mesh import build as build_mesh
from shardwise.mesh import layout_of as mesh_layout_of
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, check_on_nonfinite
from shardwise.transforms.base import Stage, Transform, check_combination, plan_of
from shardwise.transforms.data_distribution import DistributeData, distribute_data
from shardwise.transforms.placement import Place, place
from shardwise.transforms.precision_policy import MixedPrecision, mixed_precision

if TYPE_CHECKING:
    from shardwise.configs import ConfigResult

__all__ = ["Pipeline", "pipeline", "Step", "Origin", "assemble"]

log = logging.getLogger(__name__)

#: Where a step of a pipeline came from: the code, a default, or a config file.
Origin = Literal["user", "default", "config"]


@attrs.frozen
class Step:
    """One transform of a pipeline, where it came from, and why (shown by ``explain()``)."""

    transform: Transform
    origin: Origin = "user"
    reason: str | None = None


def _defaults(env: Env, given: list[Transform]) -> list[Step]:
    """The transforms the env calls for that the user did not give, each with its reason."""
    chosen: list[Step] = []
    # a DeepSpeed config decides the precision itself: no default beside it
    decided = any(getattr(t, "decides_precision", False) for t in given)
    if not decided and not any(isinstance(t, MixedPrecision) for t in given):
        name, reason = precision.default(env.device, env.precisions)
        chosen.append(Step(mixed_precision(name), "default", reason))
    if not any(isinstance(t, Place) for t in given):
        chosen.append(Step(place(), "default"))
    if not any(isinstance(t, DistributeData) for t in given):
        chosen.append(Step(distribute_data(), "default",
                           "default: applies when a loader is passed"))
    return chosen


@attrs.frozen
class Pipeline:
    """An env and its transforms in canonical order; call it on a model to get a :class:`Bundle`.

    Example:
        >>> pipe = sw.pipeline(sw.detect(), sw.accumulate_gradients(2))
        >>> print(pipe.explain())
        >>> bundle = pipe(model, optimizer, loader)
    """

    env: Env
    steps: tuple[Step, ...]
    on_nonfinite: OnNonFinite = "raise"
    choose_distribution: bool = False
    notes: tuple[str, ...] = ()
    fit_options: Mapping[str, Any] = attrs.field(factory=dict, hash=False,
                                                 converter=lambda m: MappingProxyType(dict(m)))
    """The ``sw.fit`` settings a config gave (:func:`shardwise.from_training_args`), for
    ``sw.fit(bundle, **pipe.fit_options)``; empty otherwise."""

    def resolve(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                *, batch: Any = None, loader: Iterable[Any] | None = None) -> Pipeline:
        """This pipeline with its default distribution chosen for ``model``.

        With several processes and no distribution transform given, replicate while the
        replicated state and activations fit in a safe share of device memory, else shard,
        else shard + checkpoint_activations, else also offload; the reason, with the
        estimated bytes, shows in :meth:`explain`. Otherwise the pipeline itself.

        Args:
            model: the model to estimate.
            optimizer: its optimizer (its state layout counts; default AdamW's).
            batch: a sample micro-batch for the activation estimate.
            loader: else the first batch of this DataLoader is built as the sample (the
                pipeline call does the same with its loader).

        Example:
            >>> pipe = sw.pipeline(sw.detect()).resolve(model, optimizer, loader=loader)
            >>> print(pipe.explain())
        """
        if not self.choose_distribution:
            return self
        if batch is None:
            batch = sample_batch(loader)
        given = [s.transform for s in self.steps]
        extra, reason = choose_distribution(self.env, given, model, optimizer, batch)
        steps = [*self.steps, *(Step(t, "default", reason) for t in extra)]
        steps.sort(key=lambda s: s.transform.stage)
        return attrs.evolve(self, steps=tuple(steps), choose_distribution=False)

    @property
    def transforms(self) -> tuple[Transform, ...]:
        """The transforms in the order they are applied."""
        return tuple(s.transform for s in self.steps)

    def explain(self, model: torch.nn.Module | None = None,
                optimizer: torch.optim.Optimizer | None = None, *, batch: Any = None,
                loader: Iterable[Any] | None = None) -> str:
        """What the pipeline will do, stage by stage, with each setting and why defaults were
        chosen; given a model, the default distribution is chosen for it first (:meth:`resolve`).
        """
        if model is not None:
            text = self.resolve(model, optimizer, batch=batch, loader=loader).explain()
            if optimizer is not None:
                text += f"\n  optimizer: {self._kernel(model, optimizer)}"
            return text
        env = self.env
        plan = plan_of(self.transforms)
        lines = [f"shardwise pipeline: {env.world_size} process(es) ({env.launcher}), "
                 f"rank {env.rank}, device {env.device}, backend {env.backend}"]
        for i, step in enumerate(self.steps, 1):
            t = step.transform
            why = f"  [{step.reason}]" if step.reason else ""
            lines.append(f"  {i}. {t.stage.name.lower():<15} {t!r}{why}")
            lines.append(f"     {'':<15} -> {t.describe_in(env, plan)}")
        lines += _mesh_lines(env, self.transforms)
        if self.choose_distribution:
            lines.append(f"  distribution: chosen per model when called ({env.world_size} "
                         "processes, none given): replicate if it fits in "
                         f"{SAFE_FRACTION:.0%} of device memory, else shard, else shard + "
                         "checkpoint_activations, else also offload; explain(model) shows it")
        lines.append(f"  non-finite loss/gradient in fp32/bf16: {self.on_nonfinite}")
        if self.on_nonfinite == "raise":
            lines.append("    torch's Adam/AdamW/momentum-free SGD run their fused kernel where "
                         "you chose no implementation: a non-finite step is skipped on the "
                         "device and raised by the next step(), an epoch's last step, sw.save, "
                         "sw.fit or bundle.check(state); no host sync per step (other "
                         "optimizers read the flag at each optimizer step; explain(model, "
                         "optimizer) says which)")
        # where shardwise deliberately differs from Accelerate, explain() says so
        lines.append("  scheduler: steps once per optimizer step (an Accelerate-prepared one "
                     "steps once per process per optimizer step)")
        lines.append("  evaluation: bundle.predict runs at the training precision; a bare "
                     "model(...) call outside step()/predict() runs without autocast")
        lines += [f"  notice: {note}" for note in self.notes]
        if self.fit_options:
            shown = ", ".join(f"{k}={v!r}" for k, v in self.fit_options.items())
            lines.append(f"  sw.fit(bundle, **pipe.fit_options): {shown}")
        return "\n".join(lines)

    def _late_check(self, plan: Plan) -> bool:
        """Whether the step may read the finiteness flag late: "raise", and no fp16 scaler
        (the switch to a fused kernel buys nothing otherwise, so it is not made)."""
        return self.on_nonfinite == "raise" and plan.precision != "fp16"

    def _kernel(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
        """What the step does with ``optimizer`` under the resolved pipeline, in words."""
        transforms = self.resolve(model, optimizer).transforms
        if not self._late_check(plan_of(transforms)):
            return (f"{type(optimizer).__name__} keeps its implementation: under "
                    f"on_nonfinite={self.on_nonfinite!r} or fp16 the finiteness flag is read "
                    "on the host at each optimizer step")
        own = [t for t in transforms if t.factory_name in ("shard_optimizer", "deepspeed")]
        if own and self.env.is_distributed or any(t.factory_name == "deepspeed" for t in own):
            return (f"{type(optimizer).__name__} keeps its implementation under "
                    f"{own[0].factory_name}(): the finiteness flag is read on the host at "
                    "each optimizer step")
        sharded = self.env.is_distributed and any(t.factory_name in ("shard", "tensor_parallel")
                                                  for t in transforms)
        return fused_kernel_choice(optimizer, model, sharded=sharded)[1]

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loader: Iterable[Any] | None = None, *, scheduler: Any = None,
                 loss_fn: LossFn | None = None,
                 eval_loader: Iterable[Any] | None = None) -> Bundle:
        """Apply the transforms to a fresh bundle of these objects, in canonical order.

        The model and optimizer are changed in place (wrapped, moved, re-bound); use the
        returned bundle's ``model``, ``optimizer`` and ``loader`` from here on. An
        ``eval_loader`` is distributed like ``loader`` (``bundle.eval_loader``); evaluate
        with ``bundle.predict`` and :func:`shardwise.gather_for_metrics`.

        Raises:
            OptimizerError: the optimizer already holds state.
        """
        _check_call(model, optimizer, loader, scheduler, loss_fn, eval_loader)
        refuse_state(optimizer)
        resolved = self.resolve(model, optimizer, loader=loader)
        ensure_process_group(self.env)
        mesh = mesh_layout_of(self.env, resolved.transforms)
        bundle = Bundle(model=model, optimizer=optimizer, loader=loader, eval_loader=eval_loader,
                        scheduler=scheduler,
                        env=self.env, plan=Plan(on_nonfinite=self.on_nonfinite), loss_fn=loss_fn,
                        mesh=build_mesh(self.env, mesh) if mesh and self.env.is_distributed
                        else None)
        for transform in resolved.transforms:
            bundle = transform(bundle)
        engine = bundle.engine
        if (optimizer is not None and not engine.owns_optimizer
                and engine.sharded_optimizer is None and self._late_check(bundle.plan)):
            # after every stage: ZeRO-1 and DeepSpeed keep the user's implementation
            log.info("optimizer: %s", use_fused_kernel(optimizer, bundle.model))
        return bundle


def _mesh_lines(env: Env, transforms: Iterable[Transform]) -> list[str]:
    """The mesh, its dimensions and why, when the pipeline has more than one."""
    mesh = mesh_layout_of(env, transforms)
    if mesh is None or not env.is_distributed:
        return []
    data = mesh.data_ranks(env.world_size)
    return [f"  mesh: {mesh.describe()} over {env.world_size} ranks; tp innermost: the "
            f"{mesh.tp} ranks of a tensor-parallel group are consecutive (on one node), as "
            "their collectives run in every layer; data split over "
            f"{' x '.join(mesh.data_names)} ({data} share(s) of each global batch, rank r "
            f"reads share r // {mesh.tp})",
            # where shardwise deliberately differs from torchtitan and Accelerate, it says so
            "  tensor parallel: parameters outside the plan (norms) stay whole on every rank "
            "as replicated DTensors, with no sequence or loss parallelism (torchtitan splits "
            "them): activations around them are whole and results equal one process's; the "
            "plan is applied to the model you pass (Accelerate has Transformers apply it in "
            "from_pretrained); every rank starts from rank 0's weights; sw.reduce(x, 'sum') "
            f"counts each group's value {mesh.tp} times"]


def _check_call(model: Any, optimizer: Any, loader: Any, scheduler: Any, loss_fn: Any,
                eval_loader: Any) -> None:
    """Refuse, before anything changes, what a step would only fail on later."""
    where = "pipeline(...)(model, optimizer, loader, ...)"

    def refuse(name: str, value: Any, accepted: str) -> None:
        raise ArgumentError(f"{where} '{name}' must be {accepted} (got {type(value).__name__}: "
                            f"{short(value)})")

    if not isinstance(model, torch.nn.Module):
        refuse("model", model, "a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        refuse("optimizer", optimizer, "a torch.optim.Optimizer or None")
    for name, value in (("loader", loader), ("eval_loader", eval_loader)):
        if value is not None and (isinstance(value, (str, bytes))
                                  or not hasattr(value, "__iter__")):
            refuse(name, value, "an iterable of batches (e.g. a DataLoader) or None")
    if scheduler is not None:
        missing = [m for m in ("step", "state_dict", "load_state_dict")
                   if not callable(getattr(scheduler, m, None))]
        if missing:
            refuse("scheduler", scheduler, "an LR scheduler (an object with step(), state_dict() "
                   "and load_state_dict(), e.g. torch.optim.lr_scheduler.CosineAnnealingLR) or "
                   f"None; it has no {', '.join(missing)}")
        if optimizer is None:
            raise ArgumentError(f"{where}: a scheduler needs the optimizer it schedules")
    if loss_fn is not None and not callable(loss_fn):
        refuse("loss_fn", loss_fn, "a callable (model, batch) -> loss or (loss, num_items)")


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
    env = envs[0] if envs else detect()
    if not (env.config_path or env.accelerate_variables):
        return assemble(env, transforms, None, on_nonfinite=on_nonfinite)
    # the config readers (and YAML) are imported only when there is a config to read
    from shardwise.configs import ConfigResult, read_config
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


def assemble(env: Env, given: list[Transform], config: ConfigResult | None, *,
             on_nonfinite: OnNonFinite = "raise", reason: str | None = None,
             notes: tuple[str, ...] = (), fit_options: Mapping[str, Any] | None = None
             ) -> Pipeline:
    """The pipeline of ``given`` (the code's transforms) and ``config``'s, whose transforms
    are added unless the code sets the same kind (or another distribution) itself; then the
    defaults. Every rule between them is checked once, here.
    """
    configured: list[Transform] = []
    if config is not None:
        kinds = {type(t) for t in given}
        distributes = any(t.stage == Stage.DISTRIBUTION for t in given)
        configured = [t for t in config.transforms if type(t) not in kinds
                      and not (distributes and t.stage == Stage.DISTRIBUTION)]
        notes = (*config.notices, *notes)
        reason = reason or config.reason
    transforms = [*configured, *given]
    check_combination(transforms)
    for transform in transforms:
        transform.check(env)
    steps = [*(Step(t, "config", reason) for t in configured), *(Step(t) for t in given)]
    steps += _defaults(env, transforms)
    steps.sort(key=lambda s: s.transform.stage)  # stable: user order kept within a stage
    mesh = mesh_layout_of(env, transforms)
    # a tensor-parallel group as large as the world leaves no data dimension to distribute
    choose = env.is_distributed and not any(t.stage == Stage.DISTRIBUTION for t in transforms) \
        and not (mesh is not None and mesh.tp == env.world_size)
    return Pipeline(env=env, steps=tuple(steps), on_nonfinite=on_nonfinite,
                    choose_distribution=choose, notes=notes, fit_options=fit_options or {})
