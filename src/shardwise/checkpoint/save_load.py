# save / load: sharded DCP checkpoints written atomically, with JSON for everything else.
"""Checkpoints on ``torch.distributed.checkpoint``.

A checkpoint is one directory per step, ``step_00001234/``, holding DCP shards of the
model and optimizer tensors (each rank writes its own), ``shardwise.json`` (train state,
optimizer hyperparameters, scheduler, scaler, data position) and ``rng/rank_NNNNN.json``.
It is written under a hidden temporary name and renamed once every rank has finished;
``latest`` names the newest complete one. Loading unpickles nothing but DCP's metadata,
through an allow-list.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.utils._pytree import tree_map

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.checkpoint import background, integrity
from shardwise.checkpoint import rng as _rng
from shardwise.checkpoint.background import AsyncSave, cause, wait_for_saves
from shardwise.checkpoint.layout import (
    LATEST,
    META,
    candidates,
    incomplete_parts,
    is_complete,
    latest_checkpoint,
    publish,
    read_json,
    write_durably,
)
from shardwise.data import DeviceLoader
from shardwise.distributed import all_agree, joined
from shardwise.errors import ArgumentError, CheckpointError
from shardwise.state import TrainState

if TYPE_CHECKING:
    from shardwise.checkpoint.safe_reader import SafeReader

__all__ = ["save", "load", "latest_checkpoint"]

log = logging.getLogger(__name__)

FORMAT = 1
#: shardwise.json's "engine" of a DCP checkpoint (the native engines)
TORCH_FORMAT = "torch"


@contextlib.contextmanager
def _dcp_quietly() -> Iterator[None]:
    """DCP warns that it 'assumes' one process when there is no group; here that is known."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def plain(value: Any, where: str) -> Any:
    """``value`` as JSON-ready data, or a clear error naming ``where``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot write {where} as JSON ({exc}); shardwise keeps "
                              "non-tensor state in JSON so that loading runs no pickle") from None


def _write_json(path: Path, data: Any) -> None:
    write_durably(path, json.dumps(data, indent=1))


def save(directory: str | os.PathLike[str], bundle: Bundle, state: TrainState, *,
         keep_last: int | None = None, blocking: bool = True) -> Path | AsyncSave:
    """Write a sharded checkpoint of ``bundle`` and ``state``; every rank must call it.

    Args:
        directory: the parent directory; the checkpoint is ``directory/step_NNNNNNNN``.
        bundle: the bundle being trained.
        state: the state after the last step (at the end of an accumulation window).
        keep_last: keep only this many complete checkpoints (older ones are deleted after
            the new one is complete).
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
    window = bundle.plan.accumulation_steps
    if state.window_batches:
        raise CheckpointError(
            f"save() at micro-step {state.micro_step} is inside an accumulation window of "
            f"{window}: the accumulated gradients would be lost; save when a window has ended "
            "(after a step whose out.stepped is True; state.window_batches == 0)")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save() 'keep_last' must be an integer >= 1 or None (got {keep_last!r})")
    if not isinstance(blocking, bool):
        raise ArgumentError(f"save() 'blocking' must be True or False (got {short(blocking)})")
    if not blocking and bundle.engine.own_checkpoint is not None:
        raise ArgumentError(f"save(blocking=False) writes DCP's files in the background; the "
                            f"{bundle.engine.name} engine saves in its own format: use "
                            "blocking=True")
    wait_for_saves()  # at most one in flight: the previous one is published first
    state = bundle.check(state)  # never save after a step whose check is still unread
    env, root = bundle.env, Path(directory)
    final, tmp = root / f"step_{state.step:08d}", root / f".tmp.step_{state.step:08d}"
    ok, problem = True, ""
    if env.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for debris in (*root.glob(".tmp.step_*"), *root.glob(".old.step_*")):
                shutil.rmtree(debris, ignore_errors=True)  # left by interrupted saves
            tmp.mkdir()
        except OSError as exc:
            ok, problem = False, str(exc)
    if not all_agree(env, ok):
        raise CheckpointError(f"cannot create checkpoint directory {tmp}: {problem or 'on rank 0'}")
    own = bundle.engine.own_checkpoint  # an engine with its own format (DeepSpeed), or None
    fresh = own is None and bundle.optimizer is not None and not bundle.optimizer.state
    model_sd: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    other: dict[str, Any] = {}
    if own is None:
        model_sd, tensors, other = bundle.engine.state_dicts(bundle.model, bundle.optimizer)
        _refuse_code(model_sd)
    meta = {"format": FORMAT, "name": final.name, "checksums": integrity.MANIFEST,
            "engine": own or TORCH_FORMAT,
            "train_state": state.to_dict(),
            "world_size": env.world_size,
            "data": _data_position(bundle, state),
            "optimizer": plain(other, "the optimizer's hyperparameters"),
            "scheduler": plain(bundle.scheduler.state_dict(), "the scheduler's state")
            if bundle.scheduler is not None else None,
            "scaler": plain(bundle.scaler.state_dict(), "the grad scaler's state")
            if bundle.scaler is not None else None}
    # torch.distributed.checkpoint is imported when first used: it costs most of a second
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    if not blocking:
        return _start_async(bundle, state, root, tmp, final, keep_last, meta, fresh,
                            {"model": model_sd, "optimizer": tensors})
    try:
        if own is None:
            with _dcp_quietly():
                dcp.save({"model": model_sd, "optimizer": tensors},
                         storage_writer=FileSystemWriter(tmp), no_dist=not joined(bundle.env))
        else:
            bundle.engine.save_own(tmp / own)  # a collective; every rank's files written
        _write_json(tmp / "rng" / f"rank_{env.rank:05d}.json", _rng.capture())
        if env.is_main:
            _write_json(tmp / META, meta)
        digests = integrity.digests_of(tmp, env.rank, own)
    except (Exception, CheckpointException) as exc:  # DCP's wraps the rank's OSError
        ok, problem, digests = False, cause(exc), {}
    if fresh and bundle.optimizer is not None:  # get_state_dict made state to save: undo it
        bundle.optimizer.state.clear()
    if not all_agree(env, ok):
        raise CheckpointError(f"writing checkpoint {final} failed ({problem or 'on another rank'})"
                              "; the previous checkpoint is intact")
    manifest = integrity.write_manifest(tmp, env, digests)  # a collective
    if env.is_main:
        try:
            _write_json(tmp / integrity.MANIFEST, manifest)
            publish(root, tmp, final, state.step, keep_last)
        except OSError as exc:
            ok, problem = False, f"{type(exc).__name__}: {exc}"
    if not all_agree(env, ok):  # nobody returns before the checkpoint is visible
        raise CheckpointError(f"publishing checkpoint {final} failed ({problem}); "
                              f"{root / LATEST} still names the previous checkpoint")
    return final


def _start_async(bundle: Bundle, state: TrainState, root: Path, tmp: Path, final: Path,
                 keep_last: int | None, meta: dict[str, Any], fresh: bool,
                 tensors: dict[str, Any]) -> AsyncSave:
    """The small files now (RNG as of this call, the record), the tensors staged to host
    memory and written in the background (:mod:`shardwise.checkpoint.background`)."""
    env = bundle.env
    ok, problem = True, ""
    try:
        _write_json(tmp / "rng" / f"rank_{env.rank:05d}.json", _rng.capture())
        if env.is_main:
            _write_json(tmp / META, meta)
    except OSError as exc:
        ok, problem = False, f"{type(exc).__name__}: {exc}"
    if not all_agree(env, ok):
        raise CheckpointError(f"writing checkpoint {final} failed ({problem or 'on another rank'})"
                              "; the previous checkpoint is intact")
    with _dcp_quietly():
        handle = background.start(env, root, tmp, final, state.step, keep_last, tensors)
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
    loader = bundle.loader
    seed = loader.seed if isinstance(loader, DeviceLoader) else None
    return {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch, "seed": seed}


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = read_json(path / META)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / META} is missing or corrupt ({exc}); the checkpoint "
                              "is partial") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META} holds a {type(meta).__name__}, not a record; "
                              "the checkpoint is corrupt")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this shardwise "
                              f"reads format {FORMAT}")
    return meta


def _flat_shapes(target: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DCP's flattened keys of ``target`` and the (global) shapes of its tensors."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            out[prefix] = tuple(value.shape)

    walk("", target)
    return out


def _check_fits(path: Path, reader: SafeReader, target: dict[str, Any],
                partial_optimizer: bool) -> None:
    """Raise, listing missing and unexpected keys and shape mismatches, unless it fits.

    With ``partial_optimizer`` (ZeRO-1, or a bundle without an optimizer, e.g. for
    evaluation) optimizer keys this rank does not load are expected.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: tuple(v.size) for k, v in reader.read_metadata().state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    wanted = _flat_shapes(target)
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(k for k in set(saved) - set(wanted)
                        if not (partial_optimizer and k.startswith("optimizer.")))
    shapes = [f"{k}: checkpoint {saved[k]}, model {wanted[k]}"
              for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]
    if missing or unexpected or shapes:
        def show(items: list[str]) -> str:
            return ", ".join(items[:20]) + (f" (+{len(items) - 20} more)" if len(items) > 20 else "")

        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: missing keys "
            f"[{show(missing)}]; unexpected keys [{show(unexpected)}]; shape mismatches "
            f"[{show(shapes)}]")


def load(directory: str | os.PathLike[str], bundle: Bundle) -> TrainState:
    """Restore a checkpoint into ``bundle`` and return its :class:`TrainState`.

    Restores the model, optimizer, scheduler, grad scaler, each rank's RNG states and the
    data position: the bundle's loader continues with the next batch of the saved epoch.
    The checkpoint may come from another world size or layout (shard, replicate, one
    process); DCP reshards it. Every rank must call it.

    Args:
        directory: a ``step_*`` directory, or the parent (then its newest complete one).
        bundle: a bundle built the same way as the one saved (any world size).

    Raises:
        CheckpointError: no complete checkpoint, a partial or corrupt one, or one that does
            not fit the model (missing/unexpected keys and shape mismatches are listed).

    Example:
        >>> state = sw.load("checkpoints", bundle)
    """
    wait_for_saves()  # a checkpoint being written is published (or failed) first
    path = _intact(Path(directory), bundle)
    ok, problem, meta, state, rng = True, "", {}, TrainState(), None
    try:  # everything JSON is read and checked on every rank before anything is changed
        meta = _read_meta(path)
        state = TrainState.from_dict(meta["train_state"])
        rng = _read_rng(path, bundle, meta)
    except (CheckpointError, KeyError, TypeError, ValueError) as exc:
        ok, problem = False, str(exc) if isinstance(exc, CheckpointError) else \
            f"{path / META} is malformed ({type(exc).__name__}: {exc})"
    if not all_agree(bundle.env, ok):
        raise CheckpointError(problem or f"loading {path} failed on another rank; nothing "
                              "was restored")
    engine = bundle.engine
    saved, mine = meta.get("engine", TORCH_FORMAT), engine.own_checkpoint or TORCH_FORMAT
    if saved != mine:
        raise CheckpointError(f"{path} was written by the {saved} engine, this bundle runs the "
                              f"{mine} engine; load it into a bundle built the same way")
    if engine.own_checkpoint is not None:
        _load_own(path, bundle, meta)
    else:
        _load_dcp(path, bundle, meta)
    if bundle.scheduler is not None and meta.get("scheduler") is not None:
        bundle.scheduler.load_state_dict(meta["scheduler"])
    if bundle.scaler is not None and meta.get("scaler") is not None:
        bundle.scaler.load_state_dict(meta["scaler"])
    if rng is not None:
        _rng.restore(rng)
    return _position_loader(bundle, state, meta["data"].get("seed"))


def _load_own(path: Path, bundle: Bundle, meta: dict[str, Any]) -> None:
    """The tensors of an engine that writes its own format (DeepSpeed): same world size."""
    engine, env = bundle.engine, bundle.env
    if meta.get("world_size") != env.world_size:
        raise CheckpointError(f"{path} was saved on {meta.get('world_size')} rank(s) by the "
                              f"{engine.own_checkpoint} engine, which partitions its state by "
                              f"rank; load it on {meta.get('world_size')} rank(s), not "
                              f"{env.world_size}")
    own, ok, problem = path / str(engine.own_checkpoint), True, ""
    try:  # every rank checks before any rank enters the engine's reader (a collective)
        engine.check_own(own)
    except CheckpointError as exc:
        ok, problem = False, str(exc)
    if not all_agree(env, ok):
        raise CheckpointError(problem or f"{path} was refused on another rank; nothing was "
                              "restored")
    try:
        engine.load_own(own)
    except CheckpointError as exc:
        ok, problem = False, str(exc)
    except Exception as exc:  # the engine's own reader: its errors are many types
        ok, problem = False, f"reading {path} failed ({cause(exc)})"
    if not all_agree(env, ok):
        raise CheckpointError(problem or f"loading {path} failed on another rank")


def _load_dcp(path: Path, bundle: Bundle, meta: dict[str, Any]) -> None:
    """The model and optimizer tensors of a DCP checkpoint, all or nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardwise.checkpoint.safe_reader import SafeLoadPlanner, SafeReader

    reader = SafeReader(path)
    engine = bundle.engine
    model_sd, tensors, _ = engine.state_dicts(bundle.model, bundle.optimizer)
    # read into copies: the model and optimizer change only once every tensor was read
    target = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                      {"model": model_sd, "optimizer": tensors})
    _check_fits(path, reader, target,
                partial_optimizer=engine.partial_optimizer or bundle.optimizer is None)
    try:
        with _dcp_quietly():
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=not joined(bundle.env))
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"reading checkpoint {path} failed ({cause(exc)}); the checkpoint "
                              "is partial or corrupt; nothing was restored") from None
    engine.load_state_dicts(bundle.model, bundle.optimizer, target, meta["optimizer"])


def _intact(root: Path, bundle: Bundle) -> Path:
    """The checkpoint to load: ``root`` itself when it is one, else the newest complete one
    under it whose files match their checksums (falling back past damaged ones, with a
    warning). Every rank takes part in the verification.

    Raises:
        CheckpointError: no complete checkpoint, or (for an explicit one) a damaged file.
    """
    explicit, lacking = is_complete(root), incomplete_parts(root)
    if lacking:
        raise CheckpointError(f"{root} is not a complete checkpoint: {', '.join(lacking)} "
                              "missing or not a file; the checkpoint is partial or corrupt")
    problems: list[str] = []
    for path in [root] if explicit else candidates(root):
        try:
            integrity.verify(path, bundle.env)
            if problems:
                log.warning("loading %s: the newer checkpoint(s) are damaged (%s)", path,
                            "; ".join(problems))
            return path
        except CheckpointError as exc:
            if explicit:
                raise
            problems.append(str(exc))
    if problems:
        raise CheckpointError(f"no intact checkpoint in {root}: {'; '.join(problems)}")
    others = sorted(p.name for p in root.glob("step_*"))
    raise CheckpointError(
        f"no complete checkpoint in {root} (a complete one holds {META} and DCP's .metadata; "
        "hidden .tmp.* directories are interrupted saves)"
        + (f"; not complete, or not published here: {', '.join(others[:10])}" if others else ""))


def _read_rng(path: Path, bundle: Bundle, meta: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's saved RNG states, or None when the world size changed (then they cannot
    be matched to ranks: logged). A missing or unreadable file is an error naming it."""
    if meta["world_size"] != bundle.env.world_size:
        log.warning("checkpoint %s was written by %d rank(s), this run has %d: random "
                    "generators are not restored (dropout and shuffling continue from the "
                    "seeds, not bit for bit)", path, meta["world_size"], bundle.env.world_size)
        return None
    rank_file = path / "rng" / f"rank_{bundle.env.rank:05d}.json"
    try:
        data = read_json(rank_file)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{rank_file} is missing or corrupt ({type(exc).__name__}); "
                              "the random generators of this rank cannot be restored") from None
    try:
        _rng.check(data)
    except ValueError as exc:
        raise CheckpointError(f"{rank_file}: {exc}") from None
    return data


def _position_loader(bundle: Bundle, state: TrainState, seed: int | None) -> TrainState:
    """Position the bundle's loader at the state's data position (the next batch of its
    epoch; a finished epoch E is position (E + 1, 0)); the state, so normalised."""
    loader = bundle.loader
    if not isinstance(loader, DeviceLoader):
        return state
    if seed is not None and loader.seed is not None and seed != loader.seed:
        raise CheckpointError(
            f"the checkpoint's data order used sampler seed {seed}, this loader uses "
            f"{loader.seed}; pass distribute_data(seed={seed}) to resume the same order")
    epoch, done = state.epoch, state.batch_in_epoch
    length = loader.epoch_length()
    if length is not None and done >= length:  # written by a release that kept (E, length)
        epoch, done = epoch + 1, 0
    loader.resume(epoch, done)
    return attrs.evolve(state, epoch=epoch, batch_in_epoch=done)
