# pipeline(): sorts transforms into the canonical order, refuses contradictions, picks defaults.
"""The pipeline: the only combinator of transforms."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, Protocol

import attrs
import torch

from shardwise import precision
from shardwise._params import param_names, rebind_optimizer, refuse_state
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.choice import choose_distribution, sample_batch
from shardwise.default_split import split_default
from shardwise.device_skip import fused_kernel_choice, use_fused_kernel
from shardwise.distributed import ensure_process_group
from shardwise.env import Env
from shardwise.errors import ArgumentError
from shardwise.explaining import describe
from shardwise.meta_init import read_pending_weights, weights_pending
from shardwise.parallel.mesh import build as build_mesh
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite
from shardwise.transforms.base import Stage, Transform, check_combination, plan_for, plan_of
from shardwise.transforms.data_distribution import DistributeData, distribute_data
from shardwise.transforms.placement import Place, place
from shardwise.transforms.precision_policy import MixedPrecision, mixed_precision

__all__ = ["Pipeline", "Step", "Origin", "Configured", "assemble"]

log = logging.getLogger(__name__)

#: Where a step of a pipeline came from: the code, a default, or a config file.
Origin = Literal["user", "default", "config"]


class Configured(Protocol):
    """What :func:`assemble` takes of a config (a reader's ``ConfigResult``): its transforms,
    the notices its reader gave, and the reason its steps show in ``explain()``."""

    @property
    def transforms(self) -> tuple[Transform, ...]: ...

    @property
    def notices(self) -> tuple[str, ...]: ...

    @property
    def reason(self) -> str: ...


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
        chosen; given a model, the default distribution is chosen for it first (:meth:`resolve`)
        and, under ``pipeline_parallel``, the layers and parameters of each stage are named.
        """
        if model is not None:
            resolved = self.resolve(model, optimizer, batch=batch, loader=loader)
            text = resolved.explain()
            staged = next((t for t in self.transforms if "pp" in t.mesh_dims()), None)
            if staged is not None and self.env.is_distributed:  # where this model is cut
                plan = plan_for(self.env, resolved.transforms)
                text += f"\n  stages: {staged.split_for(model, plan).describe()}"  # type: ignore[attr-defined]
            if optimizer is not None:
                text += f"\n  optimizer: {self._kernel(model, optimizer)}"
            return text
        return describe(self.env, [(s.transform, s.reason) for s in self.steps],
                        choose_distribution=self.choose_distribution,
                        on_nonfinite=self.on_nonfinite, notes=self.notes,
                        fit_options=self.fit_options)

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
        own = [t for t in transforms if t.keeps_optimizer is not None]
        if own and self.env.is_distributed or any(t.keeps_optimizer == "always" for t in own):
            return (f"{type(optimizer).__name__} keeps its implementation under "
                    f"{own[0].factory_name}(): the finiteness flag is read on the host at "
                    "each optimizer step")
        # parameters become DTensors on a mesh: the pipeline's, or a shard() of the user's own
        sharded = self.env.is_distributed and any(
            t.mesh_dims() or getattr(t, "mesh", None) is not None for t in transforms)
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
        # the mesh's layout, worked out once here and read by every transform, engine, the
        # data split and the step from the bundle's plan
        mesh = plan_for(self.env, resolved.transforms).mesh
        bundle = Bundle(model=model, optimizer=optimizer, loader=loader, eval_loader=eval_loader,
                        scheduler=scheduler, env=self.env,
                        plan=Plan(on_nonfinite=self.on_nonfinite, mesh=mesh), loss_fn=loss_fn,
                        mesh=build_mesh(self.env, mesh) if mesh and self.env.is_distributed
                        else None)
        # init_on_meta(weights=): read before a layout that keeps the whole model on every
        # rank, after the ones that split it (each rank reads its parts)
        if weights_pending(model) is not None and \
                not any(t.splits_weights for t in resolved.transforms):
            _read_weights(model, model, optimizer, self.env, self.env.device)
        for transform in resolved.transforms:
            bundle = transform(bundle)
        if weights_pending(model) is not None:
            device = torch.device("cpu") if bundle.plan.offload else self.env.device
            _read_weights(bundle.engine.unwrap(bundle.model), model, optimizer, self.env, device)
        engine = bundle.engine
        if (optimizer is not None and not engine.owns_optimizer
                and engine.sharded_optimizer is None and self._late_check(bundle.plan)):
            # after every stage: ZeRO-1 and DeepSpeed keep the user's implementation
            log.info("optimizer: %s", use_fused_kernel(optimizer, bundle.model))
        return bundle


def _read_weights(module: torch.nn.Module, root: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, env: Env, device: torch.device) -> None:
    """The weights ``init_on_meta(weights=)`` left to read, allocated and read into
    ``module`` (this rank's part), the optimizer re-bound to the allocated parameters."""
    names = param_names(module)
    read_pending_weights(module, root, env, device)
    rebind_optimizer(optimizer, names, module)


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


def assemble(env: Env, given: list[Transform], config: Configured | None, *,
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
    plan_for(env, transforms)  # a size that does not divide the world: refused here, at once
    steps = [*(Step(t, "config", reason) for t in configured), *(Step(t) for t in given)]
    steps += _defaults(env, transforms)
    distributes = any(t.stage == Stage.DISTRIBUTION for t in transforms)
    # split layers or stages: shard() over the ranks holding each part, or nothing (known
    # before the model is: not a memory question)
    split = None if distributes else split_default(env, transforms)
    if split is not None:
        steps += [Step(t, "default", split[1]) for t in split[0]]
        notes = notes if split[0] else (*notes, f"no distribution transform: {split[1]}")
    steps.sort(key=lambda s: s.transform.stage)  # stable: user order kept within a stage
    choose = env.is_distributed and not distributes and split is None
    return Pipeline(env=env, steps=tuple(steps), on_nonfinite=on_nonfinite,
                    choose_distribution=choose, notes=notes, fit_options=fit_options or {})
