# save / load: sharded DCP checkpoints written atomically, with JSON for everything else.
"""Checkpoints on ``torch.distributed.checkpoint``.

A checkpoint is one directory per step, ``step_00001234/``, holding DCP shards of the
model and optimizer tensors (each rank writes its own), ``shardwise.json`` (train state,
optimizer hyperparameters, scheduler, scaler, data position) and ``rng/rank_NNNNN.json``.
It is written under a hidden temporary name and renamed once every rank has finished;
``latest`` names the newest complete one. Loading unpickles nothing but DCP's metadata,
through an allow-list. The steps of loading are in ``restore.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.checkpoint import background, integrity, typed_json
from shardwise.checkpoint import rng as _rng
from shardwise.checkpoint.background import AsyncSave, cause, wait_for_saves
from shardwise.checkpoint.compatibility import (
    check_parts,
    check_skip,
    parts_of,
    refusal,
    scheduler_loads,
    whole_model_groups,
)
from shardwise.checkpoint.layout import (
    FORMAT,
    LATEST,
    META,
    OLD,
    TORCH_FORMAT,
    check_name,
    is_complete,
    latest_checkpoint,
    named,
    rng_file,
    write_durably,
)
from shardwise.checkpoint.lock import RootLock, share
from shardwise.checkpoint.restore import (
    check_tensors,
    dcp_quietly,
    intact,
    load_dcp,
    load_own,
    plan_position,
    position_loader,
    read_meta,
    read_rng,
)
from shardwise.checkpoint.transaction import (
    TMP,
    PublishedError,
    begin,
    describe_os_error,
    seal_and_publish,
)
from shardwise.data import DeviceLoader
from shardwise.distributed import all_agree, from_main, joined
from shardwise.env import Env
from shardwise.errors import ArgumentError, CheckpointError
from shardwise.state import TrainState

__all__ = ["save", "load", "latest_checkpoint"]


def plain(value: Any, where: str) -> Any:
    """``value`` as JSON-ready data, or a clear error naming ``where``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot write {where} as JSON ({exc}); shardwise keeps "
                              "non-tensor state in JSON so that loading runs no pickle") from None


def _write_json(path: Path, data: Any) -> None:
    write_durably(path, json.dumps(data, indent=1))


def _write_small_files(tmp: Path, env: Env, meta: dict[str, Any]) -> None:
    """This rank's generator states as of now, and on rank 0 the record (``shardwise.json``)."""
    _write_json(rng_file(tmp, env.rank), _rng.capture())
    if env.is_main:
        _write_json(tmp / META, meta)


def save(directory: str | os.PathLike[str], bundle: Bundle, state: TrainState, *,
         keep_last: int | None = None, blocking: bool = True,
         name: str | None = None) -> Path | AsyncSave:
    """Write a sharded checkpoint of ``bundle`` and ``state``; every rank must call it.

    Args:
        directory: the parent directory; the checkpoint is ``directory/step_NNNNNNNN``.
        bundle: the bundle being trained.
        state: the state after the last step (at the end of an accumulation window).
        keep_last: keep only this many complete step checkpoints (older ones are deleted
            after the new one is complete; named ones are never deleted).
        name: a named checkpoint, ``directory/<name>`` (``"best"``), beside the step
            checkpoints: saved as a transaction as they are, replaced by the next save of the
            same name, never pruned by ``keep_last``, not what ``latest`` names; loaded with
            ``sw.load(directory, bundle, name=...)``.
        blocking: ``False`` returns as soon as the state is copied to host memory; the
            files are written in the background and the checkpoint is published (checksums,
            ``latest``, ``keep_last``) once every rank's are written. At most one save is in
            flight: a later save, ``sw.load`` and the process's end wait for it.

    Returns:
        The checkpoint's directory; with ``blocking=False`` an
        :class:`~shardwise.checkpoint.background.AsyncSave` handle (``done()``, ``result()``
        -> the directory, raising :class:`CheckpointError` if the save failed).

    Raises:
        CheckpointError: mid-window state, unwritable directory or full disk (the previous
            checkpoint is left intact), or state that cannot be written safely.
        NonFiniteError: the last optimizer step, checked late, was not finite (nothing is
            written).

    Example:
        >>> sw.save("checkpoints", bundle, state, keep_last=3)
    """
    _check_save(bundle, state, keep_last, blocking, name)
    wait_for_saves()  # at most one in flight: the previous one is published first
    state = bundle.check(state)  # never save after a step whose check is still unread
    bundle.engine.synchronise_replicas(bundle.model, bundle.optimizer)  # local SGD: one state
    env, root = bundle.env, Path(directory)
    final = root / (name if name is not None else f"step_{state.step:08d}")
    tmp = root / f"{TMP}{final.name}"
    lock = begin(env, root, tmp)  # rank 0 holds the root's lock until published (or failed)
    try:
        own = bundle.engine.own_checkpoint  # an engine with its own format (DeepSpeed), or None
        fresh = own is None and bundle.optimizer is not None and not bundle.optimizer.state
        model_sd: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        other: dict[str, Any] = {}
        if own is None:
            model_sd, tensors, other = bundle.engine.state_dicts(bundle.model, bundle.optimizer)
            _refuse_code(model_sd)
            other = whole_model_groups(bundle, other)  # a collective under pipeline stages
        meta = _record(bundle, state, final, own, other)
        dcp_state = {"model": model_sd, "optimizer": tensors}
        if not blocking:
            handle = _start_async(bundle, state, root, tmp, final, keep_last, meta, fresh,
                                  dcp_state, lock)
            lock = None  # the background thread releases it once the save has ended
            return handle
        ok, problem, written = _write(bundle, tmp, own, meta, dcp_state)
        if fresh and bundle.optimizer is not None:  # get_state_dict made state to save: undo it
            bundle.optimizer.state.clear()
        if not all_agree(env, ok):
            raise CheckpointError(f"writing checkpoint {final} failed "
                                  f"({problem or 'on another rank'}); the previous checkpoint "
                                  "is intact")
        every = integrity.gather_written(env, written)  # a collective
        ok, problem = True, ""
        if env.is_main:
            try:
                seal_and_publish(root, tmp, final, state.step, keep_last, env.world_size, every,
                                 own)
            except PublishedError as exc:
                ok, problem = False, str(exc)
            except OSError as exc:
                ok, problem = False, (f"publishing checkpoint {final} failed "
                                      f"({describe_os_error(exc)}); {root / LATEST} still "
                                      "names the previous checkpoint")
        if not all_agree(env, ok):  # nobody returns before the checkpoint is visible
            raise CheckpointError(from_main(env, problem))
        return final
    finally:
        if lock is not None:
            lock.release()


def _check_save(bundle: Bundle, state: TrainState, keep_last: Any, blocking: Any,
                name: Any) -> None:
    """Refuse, before anything is written, what save() cannot do."""
    if not isinstance(bundle, Bundle) or not isinstance(state, TrainState):
        raise ArgumentError(
            f"save(directory, bundle, state): got a {type(bundle).__name__} as bundle and a "
            f"{type(state).__name__} as state; pass the directory first, then the Bundle, then "
            "the TrainState step() returned")
    if name is not None:
        try:
            check_name(name, "save()")
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        if keep_last is not None:
            raise ArgumentError(f"save(name={name!r}, keep_last={keep_last!r}): keep_last prunes "
                                "step checkpoints and a named one is never pruned; save it "
                                "without keep_last")
    if state.window_batches:
        raise CheckpointError(
            f"save() at micro-step {state.micro_step} is inside an accumulation window of "
            f"{bundle.plan.accumulation_steps}: the accumulated gradients would be lost; save "
            "when a window has ended (after a step whose out.stepped is True; "
            "state.window_batches == 0)")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save() 'keep_last' must be an integer >= 1 or None (got {keep_last!r})")
    if not isinstance(blocking, bool):
        raise ArgumentError(f"save() 'blocking' must be True or False (got {short(blocking)})")
    if not blocking and bundle.engine.own_checkpoint is not None:
        raise ArgumentError(f"save(blocking=False) writes DCP's files in the background; the "
                            f"{bundle.engine.name} engine saves in its own format: use "
                            "blocking=True")


def _record(bundle: Bundle, state: TrainState, final: Path, own: str | None,
            other: dict[str, Any]) -> dict[str, Any]:
    """``shardwise.json``: everything but the tensors, as plain JSON."""
    return {"format": FORMAT, "name": final.name, "checksums": integrity.MANIFEST,
            "engine": own or TORCH_FORMAT,
            "train_state": state.to_dict(),
            "world_size": bundle.env.world_size,
            "parts": parts_of(bundle),
            "data": _data_position(bundle, state),
            "optimizer": plain(other, "the optimizer's hyperparameters"),
            "scheduler": plain(typed_json.encode(bundle.scheduler.state_dict()),
                               "the scheduler's state")
            if bundle.scheduler is not None else None,
            "scaler": plain(typed_json.encode(bundle.scaler.state_dict()),
                            "the grad scaler's state")
            if bundle.scaler is not None else None}


def _write(bundle: Bundle, tmp: Path, own: str | None, meta: dict[str, Any],
           tensors: dict[str, Any]) -> tuple[bool, str, integrity.Written]:
    """This rank's files (DCP shards or the engine's own, RNG, and on rank 0 the record):
    whether they were written, why not, and their checksums."""
    # torch.distributed.checkpoint is imported when first used: it costs most of a second
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    env = bundle.env
    try:
        if own is None:
            with dcp_quietly(), _without_zip_crc():
                dcp.save(tensors, storage_writer=FileSystemWriter(tmp), no_dist=not joined(env))
        else:
            bundle.engine.save_own(tmp / own)  # a collective; every rank's files written
        _write_small_files(tmp, env, meta)
        return True, "", integrity.digests_of(tmp, env.rank, own)
    except (Exception, CheckpointException) as exc:  # DCP's wraps the rank's OSError
        return False, cause(exc, tmp), {}


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """torch.save's CRC-32 of each record off while DCP writes a blocking save:
    ``checksums.json``'s SHA-256 covers every byte, loading does not need it, and it is about
    a sixth of a small checkpoint's write. torch's switch is process-wide, so a save in the
    background (user code runs meanwhile) keeps it."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # a torch without the switch: its CRC-32 stays
        yield
        return
    save_config = config.save
    before = save_config.compute_crc32
    save_config.compute_crc32 = False
    try:
        yield
    finally:
        save_config.compute_crc32 = before


def _start_async(bundle: Bundle, state: TrainState, root: Path, tmp: Path, final: Path,
                 keep_last: int | None, meta: dict[str, Any], fresh: bool,
                 tensors: dict[str, Any], lock: RootLock | None) -> AsyncSave:
    """The small files now (RNG as of this call, the record), the tensors staged to host
    memory and written in the background (:mod:`shardwise.checkpoint.background`)."""
    env = bundle.env
    ok, problem = True, ""
    try:
        _write_small_files(tmp, env, meta)
    except OSError as exc:
        ok, problem = False, f"{type(exc).__name__}: {exc}"
    if not all_agree(env, ok):
        raise CheckpointError(f"writing checkpoint {final} failed ({problem or 'on another rank'})"
                              "; the previous checkpoint is intact")
    with dcp_quietly():
        handle = background.start(env, root, tmp, final, state.step, keep_last, tensors, lock)
    if fresh and bundle.optimizer is not None:  # staged already: undo what get_state_dict made
        bundle.optimizer.state.clear()
    return handle


def _refuse_code(model_sd: dict[str, Any]) -> None:
    """Raise unless every non-tensor entry (a module's extra state) is plain data, which
    loading can read without running code."""
    def plain_data(value: Any) -> bool:
        if isinstance(value, (torch.Tensor, str, int, float, bool)) or value is None:
            return True
        if isinstance(value, (list, tuple)):
            return all(plain_data(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, (str, int)) and plain_data(v) for k, v in value.items())
        return False

    for key, value in model_sd.items():
        if not plain_data(value):
            module = key.rsplit(".", 1)[0] if "." in key else "the model"
            raise CheckpointError(
                f"{key!r}: the extra state of {module} is a {type(value).__name__}, not plain "
                "data (numbers, strings, lists, dicts, tensors); a checkpoint holding it could "
                "run code when loaded, so it is not written. Return plain data or tensors from "
                "get_extra_state()")


def _data_position(bundle: Bundle, state: TrainState) -> dict[str, Any]:
    """The epoch, this rank's batches of it, and the global cursor into its order (with the
    dataset's length): what a resume at any world size and batch size continues from."""
    loader = bundle.loader
    if not isinstance(loader, DeviceLoader):
        return {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch, "seed": None}
    cursor = loader.cursor(state.epoch, state.batch_in_epoch)
    if cursor is None:  # not shardwise's sampler: it can resume at epoch ends only
        return {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
                "seed": loader.seed, "cursor": None}
    return {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch, "seed": loader.seed,
            "cursor": cursor, "samples": len(loader.sampler.dataset),
            "shuffle": bool(loader.sampler.shuffle)}


def load(directory: str | os.PathLike[str], bundle: Bundle, *,
         skip: Iterable[str] = (), name: str | None = None) -> TrainState:
    """Restore a checkpoint into ``bundle`` and return its :class:`TrainState`.

    Restores the model, optimizer, scheduler, grad scaler, each rank's RNG states and the
    data position: the bundle's loader continues with the next sample of the saved epoch,
    also at another world size or batch size (a global cursor into the epoch's order).
    The checkpoint may come from another world size or layout (shard, replicate, one
    process); DCP reshards it. Every rank must call it. All or nothing: every check runs
    before anything changes, and gradients left from an unfinished window are cleared.
    Under :func:`shardwise.fault_tolerant` the group then joins its peers' quorum, and heals
    from them where they are ahead (their state is returned).

    Args:
        directory: a ``step_*`` directory, or the parent (then its newest complete one).
        bundle: a bundle built the same way as the one saved (any world size).
        skip: parts changed on purpose, neither checked nor loaded: ``"optimizer"``,
            ``"scheduler"``, ``"scaler"``, ``"rng"``.
        name: the named checkpoint ``directory/<name>`` (saved with ``sw.save(...,
            name=...)``) instead of the newest step checkpoint.

    Raises:
        CheckpointError: no complete checkpoint, a partial or corrupt one, or one that does
            not fit the bundle (keys and shapes, optimizer and scheduler classes, parameter
            groups, scaler, sampler seed, dataset, data position); nothing was changed.
        ArgumentError: ``skip`` names something else.

    Example:
        >>> state = sw.load("checkpoints", bundle)
        >>> state = sw.load("checkpoints", bundle, skip=("optimizer", "scheduler"))
    """
    skipped = check_skip(skip, bundle.engine.own_checkpoint)
    if name is not None:
        try:
            check_name(name, "load()")
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
    wait_for_saves()  # a checkpoint being written is published (or failed) first
    directory = Path(directory)
    if name is not None:
        if (directory / name).is_symlink():
            raise CheckpointError(f"{directory / name} is a symlink; a named checkpoint is "
                                  "never followed out of its root (it could load another "
                                  "run's weights). Load the target by its own path")
        if not (directory / name).is_dir() and not (directory / (OLD + name)).is_dir():
            raise CheckpointError(f"{directory} holds no checkpoint named {name!r} (no "
                                  f"{directory / name})")
        directory = named(directory, name)
    # rank 0 holds the root's lock shared until every rank has read: another job's save (its
    # keep_last) waits, never deleting what is being read
    reading = share(directory.parent if is_complete(directory) else directory) \
        if bundle.env.is_main else None
    try:
        state = _load(directory, bundle, skipped)
        all_agree(bundle.env, True)  # every rank has read its files
    finally:
        if reading is not None:
            reading.release()
    # under fault_tolerant the group joins its peers here: where they are ahead, it heals
    return bundle.engine.begin(bundle, state)


def _load(directory: Path, bundle: Bundle, skipped: frozenset[str]) -> TrainState:
    """The load itself: find, check, then change (see :func:`load`)."""
    path = intact(directory, bundle)
    meta, state, rng, position = _checked(path, bundle, skipped)
    optimizer = None if "optimizer" in skipped else bundle.optimizer
    if bundle.engine.own_checkpoint is not None:
        load_own(path, bundle, meta)
    else:
        load_dcp(path, bundle, meta, optimizer)
    if bundle.scheduler is not None and meta.get("scheduler") is not None \
            and "scheduler" not in skipped:
        bundle.scheduler.load_state_dict(typed_json.decode(meta["scheduler"]))
    if bundle.scaler is not None and meta.get("scaler") is not None and "scaler" not in skipped:
        bundle.scaler.load_state_dict(typed_json.decode(meta["scaler"]))
    if rng is not None:
        _rng.restore(rng)
    for param in bundle.model.parameters():  # a window cut short: its gradients do not carry
        param.grad = None
    return position_loader(bundle, state, position)


def _checked(path: Path, bundle: Bundle, skipped: frozenset[str]
             ) -> tuple[dict[str, Any], TrainState, dict[str, Any] | None, tuple[int, int, int]]:
    """Everything a load reads and checks before it changes anything, agreed by every rank:
    the record, the state, this rank's RNG, the parts and the data position."""
    ok, problem = True, ""
    meta: dict[str, Any] = {}
    state, rng, position = TrainState(), None, (0, 0, 0)
    try:
        meta = read_meta(path)
        _check_weights_only(path, meta, skipped)
        state = TrainState.from_dict(meta["train_state"])
        saved, mine = meta.get("engine", TORCH_FORMAT), bundle.engine.own_checkpoint or TORCH_FORMAT
        if saved != mine:
            raise CheckpointError(f"{path} was written by the {saved} engine, this bundle runs "
                                  f"the {mine} engine; load it into a bundle built the same way")
        problems = check_tensors(path, bundle, None if "optimizer" in skipped
                                 else bundle.optimizer, meta)
        problems += check_parts(path, meta, bundle, skipped)
        if "scheduler" not in skipped:
            problems += scheduler_loads(bundle, meta.get("scheduler"))
        try:
            position = plan_position(bundle, state, meta["data"])
        except CheckpointError as exc:
            problems.append(str(exc))
        if problems:
            raise refusal(path, problems)
        rng = None if "rng" in skipped else read_rng(path, bundle, meta)
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError) as exc:
        ok, problem = False, str(exc) if isinstance(exc, CheckpointError) else \
            f"{path / META} is malformed ({type(exc).__name__}: {exc})"
    if not all_agree(bundle.env, ok):
        raise CheckpointError(problem or f"loading {path} failed on another rank; nothing "
                              "was restored")
    return meta, state, rng, position


def _check_weights_only(path: Path, meta: dict[str, Any], skipped: frozenset[str]) -> None:
    """Refuse a weights-only checkpoint (``shardwise from-hf``) unless every other part is
    skipped: loading it would start them fresh, which the caller must say."""
    from shardwise.checkpoint.from_hf import WEIGHTS_ONLY_SKIP

    if meta.get("weights_only") is None or set(WEIGHTS_ONLY_SKIP) <= skipped:
        return
    raise CheckpointError(
        f"{path} holds a model's weights only (written by shardwise from-hf from "
        f"{short(meta['weights_only'])}): no optimizer state, scheduler, grad scaler or random "
        f"generators. Load it with sw.load(..., skip={WEIGHTS_ONLY_SKIP!r}); those parts "
        "then start as the bundle has them")
