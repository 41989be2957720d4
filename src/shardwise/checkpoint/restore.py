# The parts of sw.load: find an intact checkpoint, check it fits, read it all or nothing.
"""What :func:`shardwise.load` does, step by step (``save_load.py`` holds the call itself).

Every check runs on every rank before anything is changed: the checkpoint verified against
its sealed checksums (falling back past damaged ones), its record and RNG files read, its
tensors' keys and shapes compared with the bundle's; then DCP reads into copies, and the
model and optimizer change only once every tensor was read.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.utils._pytree import tree_map

from shardwise.bundle import Bundle
from shardwise.checkpoint import integrity
from shardwise.checkpoint import rng as _rng
from shardwise.checkpoint.background import cause
from shardwise.checkpoint.compatibility import stage_groups
from shardwise.checkpoint.layout import (
    FORMAT,
    META,
    candidates,
    incomplete_parts,
    is_complete,
    read_json,
    rng_file,
)
from shardwise.data import DeviceLoader
from shardwise.distributed import all_agree, from_main, joined
from shardwise.errors import CheckpointError, DataError
from shardwise.state import TrainState

if TYPE_CHECKING:
    from shardwise.checkpoint.safe_reader import SafeReader

__all__ = ["check_tensors", "dcp_quietly", "intact", "read_meta", "read_rng", "load_own", "load_dcp",
           "plan_position", "position_loader"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def dcp_quietly() -> Iterator[None]:
    """DCP warns that it 'assumes' one process when there is no group; here that is known."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


@contextlib.contextmanager
def _no_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                  keep: bool) -> Iterator[None]:
    """Gradients set aside while torch's ``get_state_dict`` runs: it gives a fresh optimizer
    state by stepping it once with zero gradients (and none if gradients exist, as in the
    middle of an accumulation window). Afterwards they come back, and a fresh optimizer's
    new state is dropped, unless the block succeeded and ``keep`` (the load went through:
    the window starts clean)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    fresh = optimizer is not None and not optimizer.state
    for param in params:
        param.grad = None
    done = False
    try:
        with _quiet_step(optimizer if fresh else None):
            yield
        done = True
    finally:
        if not (done and keep):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            if fresh and optimizer is not None:
                optimizer.state.clear()


@contextlib.contextmanager
def _quiet_step(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """The optimizer's step hooks, and torch's global ones, set aside while torch steps a
    fresh optimizer with zero gradients to make its state: that step is not training (an
    EMA or a logger hooked on it must not see it)."""
    if optimizer is None:
        yield
        return
    from torch.optim import optimizer as module

    tables = [getattr(optimizer, "_optimizer_step_pre_hooks", None),
              getattr(optimizer, "_optimizer_step_post_hooks", None),
              getattr(module, "_global_optimizer_pre_hooks", None),
              getattr(module, "_global_optimizer_post_hooks", None)]
    saved = [dict(t) if t is not None else None for t in tables]
    for table in tables:
        if table is not None:
            table.clear()
    try:
        yield
    finally:
        for table, content in zip(tables, saved, strict=True):
            if table is not None and content is not None:
                table.update(content)


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's record (``shardwise.json``), checked to be one of this format."""
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


def _fit_problems(reader: SafeReader, target: dict[str, Any], partial_optimizer: bool,
                  elsewhere: frozenset[str] = frozenset()) -> list[str]:
    """Missing and unexpected keys and shape mismatches, in one line; [] when it fits.

    With ``partial_optimizer`` (ZeRO-1, or a bundle without an optimizer, e.g. for
    evaluation) optimizer keys this rank does not load are expected; so are the keys in
    ``elsewhere`` (another pipeline stage's).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: tuple(v.size) for k, v in reader.read_metadata().state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    wanted = _flat_shapes(target)
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(k for k in set(saved) - set(wanted) - elsewhere
                        if not (partial_optimizer and k.startswith("optimizer.")))
    shapes = [f"{k}: checkpoint {saved[k]}, model {wanted[k]}"
              for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]
    if not (missing or unexpected or shapes):
        return []

    def show(items: list[str]) -> str:
        return ", ".join(items[:20]) + (f" (+{len(items) - 20} more)" if len(items) > 20 else "")

    return [f"model/optimizer tensors: missing keys [{show(missing)}]; unexpected keys "
            f"[{show(unexpected)}]; shape mismatches [{show(shapes)}]"]


def check_tensors(path: Path, bundle: Bundle, optimizer: torch.optim.Optimizer | None,
                  meta: dict[str, Any] | None = None) -> list[str]:
    """How the checkpoint's tensors (DCP's metadata) differ from the bundle's model and
    ``optimizer`` in keys and shapes, and (given the record ``meta``) which of this rank's
    parameters its param groups miss; [] when they fit, or for an engine's own format."""
    from shardwise.checkpoint.compatibility import uncovered_groups
    from shardwise.checkpoint.safe_reader import SafeReader

    engine = bundle.engine
    if engine.own_checkpoint is not None:
        return []
    with _no_gradients(bundle.model, optimizer, keep=False):  # nothing may change yet
        model_sd, tensors, other = engine.state_dicts(bundle.model, optimizer)
        target = {"model": model_sd, "optimizer": tensors}
        problems = _fit_problems(SafeReader(path), target,
                                 engine.partial_optimizer or optimizer is None,
                                 _other_stages(bundle, target))
        if optimizer is not None and meta is not None:
            problems += uncovered_groups(meta, other)
        return problems


def _other_stages(bundle: Bundle, target: dict[str, Any]) -> frozenset[str]:
    """The keys the other ranks of this rank's pipeline group load (each holds its stages'
    part of the model and optimizer): a collective over the group; none without stages."""
    stages = bundle.stages
    if stages is None:
        return frozenset()
    import torch.distributed as dist

    keys = sorted(_flat_shapes(target))
    every: list[Any] = [None] * stages.size
    dist.all_gather_object(every, keys, group=stages.group)
    return frozenset(k for theirs in every for k in theirs)


def load_own(path: Path, bundle: Bundle, meta: dict[str, Any]) -> None:
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


def load_dcp(path: Path, bundle: Bundle, meta: dict[str, Any],
             optimizer: torch.optim.Optimizer | None) -> None:
    """The model and ``optimizer``'s tensors (None: the model's only) of a DCP checkpoint,
    all or nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardwise.checkpoint.safe_reader import SafeLoadPlanner, SafeReader

    reader = SafeReader(path)
    engine = bundle.engine
    with _no_gradients(bundle.model, optimizer, keep=True):  # kept only if the load succeeds
        model_sd, tensors, mine = engine.state_dicts(bundle.model, optimizer)
        # read into copies: the model and optimizer change only once every tensor was read
        target = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                          {"model": model_sd, "optimizer": tensors})
        problems = _fit_problems(reader, target, engine.partial_optimizer or optimizer is None,
                                 _other_stages(bundle, target))
        if problems:  # checked before the load began; a file changed since
            raise CheckpointError(f"checkpoint {path} does not fit this bundle: {problems[0]}")
        try:
            with dcp_quietly():
                dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(),
                         no_dist=not joined(bundle.env))
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"reading checkpoint {path} failed ({cause(exc)}); the "
                                  "checkpoint is partial or corrupt; nothing was restored"
                                  ) from None
        saved = meta["optimizer"]
        if bundle.stages is not None and optimizer is not None:  # this stage's groups only
            saved = stage_groups(saved, mine)
        engine.load_state_dicts(bundle.model, optimizer, target, saved)


def intact(root: Path, bundle: Bundle) -> Path:
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
    env = bundle.env
    if explicit:
        integrity.verify(root, env)
        return root
    # rank 0 reads `latest` and the directory, and every rank verifies what it names: ranks
    # that looked on their own could pick different checkpoints while a writer publishes
    found = candidates(root) if env.is_main else iter(())
    problems: list[str] = []
    while (path := from_main(env, next(found, None))) is not None:
        try:
            integrity.verify(path, env)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            log.warning("loading %s: the newer checkpoint(s) are damaged (%s)", path,
                        "; ".join(problems))
        return path
    if problems:
        raise CheckpointError(f"no intact checkpoint in {root}: {'; '.join(problems)}")
    others = sorted(p.name for p in root.glob("step_*"))
    raise CheckpointError(
        f"no complete checkpoint in {root} (a complete one holds {META} and DCP's .metadata; "
        "hidden .tmp.* directories are interrupted saves)"
        + (f"; not complete, or not published here: {', '.join(others[:10])}" if others else ""))


def read_rng(path: Path, bundle: Bundle, meta: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's saved RNG states, or None when the world size changed (then they cannot
    be matched to ranks: logged). A missing or unreadable file is an error naming it."""
    if meta["world_size"] != bundle.env.world_size:
        log.warning("checkpoint %s was written by %d rank(s), this run has %d: random "
                    "generators are not restored (dropout and shuffling continue from the "
                    "seeds, not bit for bit)", path, meta["world_size"], bundle.env.world_size)
        return None
    rank_file = rng_file(path, bundle.env.rank)
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


def plan_position(bundle: Bundle, state: TrainState, data: dict[str, Any]
                  ) -> tuple[int, int, int]:
    """Where the bundle's loader continues: (epoch, batch_in_epoch, global cursor), checked
    against the loader (its seed, whether it can start mid-epoch, its dataset) and worked
    out for this world size and batch size. Changes nothing.

    Raises:
        CheckpointError: the loader cannot continue the saved position exactly.
    """
    loader = bundle.loader
    if not isinstance(loader, DeviceLoader):
        return state.epoch, state.batch_in_epoch, 0
    seed = data.get("seed")
    if seed is not None and loader.seed is not None and seed != loader.seed:
        raise CheckpointError(
            f"the checkpoint's data order used sampler seed {seed}, this loader uses "
            f"{loader.seed}; pass distribute_data(seed={seed}) to resume the same order")
    epoch, done = state.epoch, state.batch_in_epoch
    length = loader.epoch_length()
    if data.get("cursor") is None and length is not None and done >= length:
        return epoch + 1, 0, 0  # written by a release that kept (E, length)
    try:
        return loader.plan_resume(epoch, done, data.get("cursor"), data.get("samples"),
                                  data.get("shuffle"))
    except DataError as exc:
        raise CheckpointError(str(exc)) from None


def position_loader(bundle: Bundle, state: TrainState, position: tuple[int, int, int]
                    ) -> TrainState:
    """Position the bundle's loader as :func:`plan_position` said; the state, so normalised."""
    loader = bundle.loader
    if not isinstance(loader, DeviceLoader):
        return state
    epoch, done, cursor = position
    loader.resume(epoch, done, cursor)
    return attrs.evolve(state, epoch=epoch, batch_in_epoch=done)
