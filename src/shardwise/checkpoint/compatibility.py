# What a checkpoint must share with the bundle it is loaded into, checked before anything changes.
"""The parts of a bundle a checkpoint records (optimizer class and parameter groups,
scheduler class, grad scaler) and the check that a bundle has the same, so that a load
refuses a mismatch by name before the first tensor, generator or counter changes.

``skip`` names the parts a user changed on purpose (torchtitan's ``exclude_from_loading``):
those are neither checked nor loaded, and keep what the bundle has.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.errors import ArgumentError, CheckpointError

__all__ = ["SKIPPABLE", "check_skip", "parts_of", "check_parts", "scheduler_loads", "refusal",
           "whole_model_groups", "uncovered_groups", "stage_groups"]

#: what ``sw.load(..., skip=...)`` may leave out
SKIPPABLE = ("optimizer", "scheduler", "scaler", "rng")


def check_skip(skip: Any, own: str | None) -> frozenset[str]:
    """``skip`` as a set of part names.

    Raises:
        ArgumentError: not an iterable of names from :data:`SKIPPABLE`, or a part an
            engine with its own format loads as a whole.
    """
    if isinstance(skip, str) or not isinstance(skip, Iterable):
        raise ArgumentError(f"load() 'skip' must be a tuple of part names from "
                            f"{', '.join(SKIPPABLE)} (got {short(skip)})")
    names = list(skip)
    wrong = [n for n in names if n not in SKIPPABLE]
    if wrong:
        raise ArgumentError(f"load() 'skip' names {short(wrong[0])}; accepted: "
                            f"{', '.join(SKIPPABLE)}")
    if own is not None and "optimizer" in names:
        raise ArgumentError(f"load(skip=('optimizer',)): the {own} engine loads model and "
                            "optimizer from its own files as a whole; load it without skipping")
    return frozenset(names)


def _qualified(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def parts_of(bundle: Bundle) -> dict[str, Any]:
    """What ``shardwise.json`` records of the bundle's parts."""
    optimizer, scheduler = bundle.optimizer, bundle.scheduler
    return {
        "optimizer": None if optimizer is None else {
            "class": _qualified(optimizer),
            # a pipeline stage's optimizer holds its part: the whole model's counts are recorded
            "groups": list(bundle.stages.group_sizes) if bundle.stages is not None
            else [len(group["params"]) for group in optimizer.param_groups]},
        "scheduler": None if scheduler is None else {"class": _qualified(scheduler)},
        "scaler": bundle.scaler is not None,
    }


def whole_model_groups(bundle: Bundle, other: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's JSON part (param groups by parameter name, non-tensor state) of the
    whole model. Under pipeline stages each rank's optimizer holds its stages' parameters
    only, and rank 0 alone writes the record: the pipeline group's parts are merged (a
    collective over it), so every stage finds its parameters' hyperparameters on load."""
    stages = bundle.stages
    if stages is None or not other:
        return other
    import torch.distributed as dist

    every: list[Any] = [None] * stages.size
    dist.all_gather_object(every, other, group=stages.group)
    groups: list[dict[str, Any]] = [dict(g, params=list(g.get("params", [])))
                                    for g in other.get("param_groups", [])]
    state: dict[str, Any] = {}
    for theirs in every:
        state.update(theirs.get("state", {}))
        for mine, group in zip(groups, theirs.get("param_groups", []), strict=True):
            mine["params"] += [n for n in group.get("params", []) if n not in mine["params"]]
    return {**other, "state": state, "param_groups": groups}


def stage_groups(saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """The record's optimizer part with each param group naming only this rank's parameters
    (``mine``: its own JSON part): a pipeline stage loads the groups of its own parameters,
    a group none of whose parameters it holds staying empty as its optimizer's is (torch
    maps saved groups to the optimizer's by the names they hold)."""
    groups = [dict(theirs, params=[n for n in theirs.get("params", [])
                                   if n in set(own.get("params", []))])
              for theirs, own in zip(saved.get("param_groups", []),
                                     mine.get("param_groups", []), strict=False)]
    return {**saved, "param_groups": groups}


def uncovered_groups(meta: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The parameters of this rank's optimizer (``other``: its JSON part, groups naming
    parameters) that the checkpoint's record gives no param group (a pipeline-parallel
    checkpoint written before the groups were merged names rank 0's parameters only: loading
    it would leave this rank's groups without their hyperparameters); [] when all are."""
    saved = (meta.get("optimizer") or {}).get("param_groups")
    if not isinstance(saved, list):
        return []
    problems = []
    for index, (mine, theirs) in enumerate(zip(other.get("param_groups", []), saved,
                                               strict=False)):
        names = theirs.get("params") if isinstance(theirs, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            continue
        missing = [n for n in mine.get("params", []) if isinstance(n, str) and n not in names]
        if missing:
            problems.append(f"optimizer param group {index}: the checkpoint records no "
                            f"hyperparameters for {len(missing)} of this rank's parameters "
                            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                            "it was written by rank 0 of a pipeline-parallel run that recorded "
                            "its own stage's groups only")
    return problems


def _optimizer(saved: dict[str, Any], mine: dict[str, Any]) -> str:
    theirs, ours = saved.get("optimizer"), mine["optimizer"]
    if "optimizer" in saved and theirs is None:
        return f"optimizer: checkpoint none (no optimizer state), bundle {ours['class']}"
    if theirs is not None and theirs.get("class") != ours["class"]:
        return f"optimizer: checkpoint {theirs.get('class')}, bundle {ours['class']}"
    if theirs is not None and theirs.get("groups") != ours["groups"]:
        return (f"optimizer parameter groups (parameters in each): checkpoint "
                f"{theirs.get('groups')}, bundle {ours['groups']}")
    return ""


def _named(present: bool, part: dict[str, Any] | None) -> str:
    if part is not None:
        return str(part.get("class"))
    return "has one" if present else "none"


def _scheduler(saved: dict[str, Any], meta: dict[str, Any], mine: dict[str, Any]) -> str:
    has = meta.get("scheduler") is not None
    theirs, ours = saved.get("scheduler"), mine["scheduler"]
    if has != (ours is not None) or (theirs is not None and ours is not None
                                     and theirs.get("class") != ours["class"]):
        return f"scheduler: checkpoint {_named(has, theirs)}, bundle {_named(False, ours)}"
    return ""


def _mismatches(saved: dict[str, Any], meta: dict[str, Any], bundle: Bundle,
                skip: frozenset[str]) -> list[str]:
    mine = parts_of(bundle)
    problems = []
    if "optimizer" not in skip and bundle.optimizer is not None:
        problems.append(_optimizer(saved, mine))
    if "scheduler" not in skip:
        problems.append(_scheduler(saved, meta, mine))
    saved_scaler = meta.get("scaler") is not None
    if "scaler" not in skip and saved_scaler != mine["scaler"]:
        problems.append(f"grad scaler (fp16): checkpoint {_named(saved_scaler, None)}, bundle "
                        f"{_named(mine['scaler'], None)}")
    return [p for p in problems if p]


def check_parts(path: Any, meta: dict[str, Any], bundle: Bundle, skip: frozenset[str]
                ) -> list[str]:
    """How the bundle's optimizer, scheduler and scaler differ from those the checkpoint
    holds (parts in ``skip`` excepted), each naming both sides; [] when they fit. A bundle
    without an optimizer (evaluation) loads the model only, so nothing else is compared.
    Checkpoints recorded before the classes were say only whether a scheduler and a scaler
    existed; that much is still compared.

    Raises:
        CheckpointError: the record's ``parts`` is not a record.
    """
    saved = meta.get("parts")
    if saved is not None and not isinstance(saved, dict):
        raise CheckpointError(f"{path}: the record's 'parts' is a {type(saved).__name__}, not a "
                              "record; the checkpoint is corrupt")
    if bundle.optimizer is None:
        return []
    return _mismatches(saved or {}, meta, bundle, skip)


def scheduler_loads(bundle: Bundle, saved: Any) -> list[str]:
    """Whether the bundle's scheduler takes the saved state: tried, then put back as it was
    (a scheduler of the same class may still be built differently, e.g. a ``SequentialLR``
    of other schedulers, and its ``load_state_dict`` fails half-way)."""
    from shardwise.checkpoint import typed_json

    scheduler = bundle.scheduler
    if scheduler is None or saved is None or bundle.optimizer is None:
        return []
    before = [(part, _copy_of(part)) for part in _parts(scheduler)]
    try:
        scheduler.load_state_dict(typed_json.decode(copy.deepcopy(saved)))
    except Exception as exc:  # whatever a scheduler raises on a state not its own
        return [f"scheduler: the checkpoint's {type(scheduler).__name__} state does not load "
                f"into this one ({type(exc).__name__}: {short(str(exc))})"]
    finally:  # every attribute back, and none added (load_state_dict only adds)
        for part, attributes in before:
            vars(part).clear()
            vars(part).update(attributes)
    return []


def _parts(scheduler: Any) -> list[Any]:
    """The scheduler and those it drives (``SequentialLR``, ``ChainedScheduler``)."""
    out = [scheduler]
    for inner in getattr(scheduler, "_schedulers", None) or []:
        out += _parts(inner)
    return out


def _copy_of(part: Any) -> dict[str, Any]:
    """A scheduler's attributes, copied but for the objects it refers to."""
    return {k: v if k in ("optimizer", "_schedulers") else copy.deepcopy(v)
            for k, v in vars(part).items()}


def refusal(path: Any, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint that does not fit: every mismatch, and how to go on."""
    named = [p for p in SKIPPABLE if any(q.startswith(p) or f" {p}" in q for q in problems)]
    hint = (" or, if you changed a part on purpose, load the rest with sw.load(..., skip=("
            + ", ".join(repr(p) for p in named) + ",))") if named else ""
    return CheckpointError(f"checkpoint {path} does not fit this bundle: {'; '.join(problems)}. "
                           f"Nothing was loaded. Build the bundle as it was saved{',' if hint else ''}"
                           f"{hint}")
