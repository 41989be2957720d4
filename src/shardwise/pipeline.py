# pipeline(): sorts transforms into the canonical order, refuses contradictions, picks defaults.
"""The pipeline: the only combinator of transforms."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

from shardwise._params import refuse_state
from shardwise.bundle import Bundle
from shardwise.choice import SAFE_FRACTION, choose_distribution, sample_batch
from shardwise.distributed import ensure_process_group
from shardwise.env import Env, detect
from shardwise.errors import ConflictError
from shardwise.plan import LossFn, Plan
from shardwise.state import OnNonFinite, check_on_nonfinite
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.distribute_data import DistributeData, distribute_data
from shardwise.transforms.mixed_precision import MixedPrecision, mixed_precision
from shardwise.transforms.offload import Offload
from shardwise.transforms.place import Place, place
from shardwise.transforms.shard import Shard
from shardwise.transforms.shard_optimizer import ShardOptimizer

__all__ = ["Pipeline", "pipeline"]


@attrs.frozen
class Step:
    """One transform of a pipeline and, when the pipeline chose it, the reason."""

    transform: Transform
    reason: str | None = None


def _defaults(env: Env, given: list[Transform]) -> list[Step]:
    """The transforms the env calls for that the user did not give, each with its reason."""
    chosen: list[Step] = []
    if not any(isinstance(t, MixedPrecision) for t in given):
        if env.device.type == "cuda" and "bf16" in env.precisions:
            chosen.append(Step(mixed_precision("bf16"),
                               f"default: {env.device} computes bf16 natively"))
        else:
            chosen.append(Step(mixed_precision("fp32"),
                               f"default: {env.device} has no fast native bf16"))
    if not any(isinstance(t, Place) for t in given):
        chosen.append(Step(place(), "always"))
    if not any(isinstance(t, DistributeData) for t in given):
        chosen.append(Step(distribute_data(), "default: applies when a loader is passed"))
    return chosen


def _check(parts: list[Transform], env: Env) -> None:
    seen: dict[type, Transform] = {}
    for part in parts:
        if type(part) in seen:
            raise ConflictError(f"{seen[type(part)]!r} and {part!r} are the same transform "
                                "given twice; keep one, with the settings you want")
        seen[type(part)] = part
    distribution = [p for p in parts if p.stage == Stage.DISTRIBUTION]
    if len(distribution) > 1:
        raise ConflictError(f"{distribution[0]!r} and {distribution[1]!r} both distribute the "
                            "model; a pipeline takes at most one distribution transform")
    for part in parts:
        if isinstance(part, MixedPrecision):
            part.check(env)
        if isinstance(part, ShardOptimizer) and any(isinstance(p, Shard) for p in parts):
            shard_part = next(p for p in parts if isinstance(p, Shard))
            raise ConflictError(f"{part!r} and {shard_part!r}: shard() already shards optimizer "
                                "state; use shard_optimizer() with replicate(), or drop it")
        if isinstance(part, Offload) and part.cpu and not any(isinstance(p, Shard) for p in parts):
            raise ConflictError(f"{part!r} needs shard(): FSDP2 carries out the offload. Add "
                                "sw.shard() to the pipeline, or remove offload()")


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
        steps = [*self.steps, *(Step(t, reason) for t in extra)]
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
            return self.resolve(model, optimizer, batch=batch, loader=loader).explain()
        env = self.env
        lines = [f"shardwise pipeline: {env.world_size} process(es) ({env.launcher}), "
                 f"rank {env.rank}, device {env.device}, backend {env.backend}"]
        for i, step in enumerate(self.steps, 1):
            t = step.transform
            why = f"  [{step.reason}]" if step.reason and step.reason != "always" else ""
            lines.append(f"  {i}. {t.stage.name.lower():<12} {t!r}{why}")
            lines.append(f"     {'':<12} -> {t.describe(env)}")
        if self.choose_distribution:
            lines.append(f"  distribution: chosen per model when called ({env.world_size} "
                         "processes, none given): replicate if it fits in "
                         f"{SAFE_FRACTION:.0%} of device memory, else shard, else shard + "
                         "checkpoint_activations, else also offload; explain(model) shows it")
        lines.append(f"  non-finite loss/gradient in fp32/bf16: {self.on_nonfinite}")
        lines += [f"  notice: {note}" for note in self.notes]
        return "\n".join(lines)

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loader: Iterable[Any] | None = None, *, scheduler: Any = None,
                 loss_fn: LossFn | None = None) -> Bundle:
        """Apply the transforms to a fresh bundle of these objects, in canonical order.

        The model and optimizer are changed in place (wrapped, moved, re-bound); use the
        returned bundle's ``model``, ``optimizer`` and ``loader`` from here on.

        Raises:
            OptimizerError: the optimizer already holds state.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"pipeline(...)(model, ...) needs a torch.nn.Module "
                            f"(got {type(model).__name__})")
        refuse_state(optimizer)
        resolved = self.resolve(model, optimizer, loader=loader)
        ensure_process_group(self.env)
        bundle = Bundle(model=model, optimizer=optimizer, loader=loader, scheduler=scheduler,
                        env=self.env, plan=Plan(on_nonfinite=self.on_nonfinite), loss_fn=loss_fn)
        for transform in resolved.transforms:
            bundle = transform(bundle)
        return bundle


def pipeline(*parts: Env | Transform, on_nonfinite: OnNonFinite = "raise") -> Pipeline:
    """Build a pipeline from at most one :class:`Env` and any transforms, in any order.

    Transforms are sorted into the canonical stages (settings, surgery, distribution,
    placement, data). What the env needs and the parts do not say is chosen by default:
    ``replicate()`` for several processes, bf16 on CUDA devices that compute it natively
    (else fp32), placement, and data distribution when a loader is passed.

    When the env's ``config_path`` is set (``shardwise launch --config_file``, or
    ``$SHARDWISE_CONFIG_FILE``), the config file's transforms (:func:`shardwise.from_config`)
    are added, except those the code gives itself (same kind, or another distribution).

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
            raise TypeError(f"pipeline() takes an Env and transforms (got {part!r} of type "
                            f"{type(part).__name__}); build transforms with sw.replicate(), ...")
    if len(envs) > 1:
        raise ConflictError(f"pipeline() got {len(envs)} Envs ({envs[0]!r} and {envs[1]!r}); "
                            "pass one")
    check_on_nonfinite(on_nonfinite, "pipeline()")
    env = envs[0] if envs else detect()
    configured, notes = _from_config_file(env, transforms)
    transforms = [*configured, *transforms]
    _check(transforms, env)
    reason = f"from config {env.config_path}"
    steps = [Step(t, reason if t in configured else None) for t in transforms]
    steps += _defaults(env, transforms)
    steps.sort(key=lambda s: s.transform.stage)  # stable: user order kept within a stage
    choose = env.is_distributed and not any(t.stage == Stage.DISTRIBUTION for t in transforms)
    return Pipeline(env=env, steps=tuple(steps), on_nonfinite=on_nonfinite,
                    choose_distribution=choose, notes=notes)


def _from_config_file(env: Env, given: list[Transform]) -> tuple[list[Transform], tuple[str, ...]]:
    """The transforms of the config file handed over in ``env.config_path`` (by
    ``shardwise launch``) that the code does not set itself, and the config's notices."""
    if not env.config_path:
        return [], ()
    from shardwise.configs import from_config

    configured = from_config(env.config_path, env=env)
    kinds = {type(t) for t in given}
    distributes = any(t.stage == Stage.DISTRIBUTION for t in given)
    chosen = [s.transform for s in configured.steps
              if s.reason and s.reason.startswith("from ")
              and type(s.transform) not in kinds
              and not (distributes and s.transform.stage == Stage.DISTRIBUTION)]
    note = (f"config {env.config_path} applied; transforms given in code take precedence "
            "over it")
    return chosen, (*configured.notes, note)
