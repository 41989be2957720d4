# A save as a transaction on the root: recover what a crash left, verify, publish in renames, prune last.
"""The file operations of publishing a checkpoint, each leaving the root loadable.

Run by the one writer that holds the root's lock (:mod:`shardwise.checkpoint.lock`):

- :func:`recover` before a save: a ``.old.step_N`` (a re-save of step N killed between its
  two renames) goes back to ``step_N`` when that is missing, or is removed when ``step_N``
  was published; hidden ``.tmp.step_*`` (never published, never returned by ``sw.save``) and
  ``.trash.*`` (being deleted) are removed.
- :func:`publish`: the new files verified against what the ranks reported writing, then
  ``step_N`` moved aside to ``.old.step_N`` if it exists, ``.tmp.step_N`` renamed to
  ``step_N``, ``latest`` replaced, the old copy and then ``keep_last``'s surplus deleted.
  Between any two of these a checkpoint of step N loads: ``sw.load`` and
  ``sw.latest_checkpoint`` take ``.old.step_N`` for step N while ``step_N`` is missing.
- A directory is deleted by renaming it to ``.trash.*`` first, so a crash mid-delete never
  leaves a half-deleted checkpoint under a published name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from shardwise.checkpoint.integrity import MANIFEST, Written, manifest_of
from shardwise.checkpoint.layout import (
    LATEST,
    META,
    OLD,
    complete_steps,
    fsync_dir,
    is_complete,
    is_step_name,
    read_json,
    step_of,
    write_durably,
)
from shardwise.checkpoint.lock import RootLock, acquire
from shardwise.distributed import all_agree, from_main
from shardwise.env import Env
from shardwise.errors import CheckpointError

__all__ = ["TMP", "TRASH", "PublishedError", "begin", "recover", "seal_and_publish", "publish", "retire",
           "check_written", "describe_os_error"]

TMP = ".tmp."
TRASH = ".trash."


def describe_os_error(exc: OSError, where: Path | None = None) -> str:
    """An ``OSError`` in words: what happened to which path."""
    path = exc.filename or where
    if exc.errno == errno.ENOSPC:
        return f"no space left on device writing {path}"
    if exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}" + (f" ({path})" if path else "")
    return f"{type(exc).__name__}: {exc}"


def begin(env: Env, root: Path, tmp: Path, names: str = "*") -> RootLock | None:
    """Rank 0 takes the root's writer lock, puts back or clears what interrupted saves left
    (:func:`recover`) and makes the hidden directory the ranks write into; every rank learns
    whether it could. The lock on rank 0 (None elsewhere).

    Raises:
        CheckpointError: on every rank, naming rank 0's reason (another writer holds the
            root, it cannot be created).
    """
    ok, problem, lock = True, "", None
    try:
        if env.is_main:
            try:
                lock = acquire(root)
                recover(root, names)
                _check_in_the_way(root, tmp.name.removeprefix(TMP))
                tmp.mkdir()
            except (OSError, CheckpointError) as exc:
                ok, problem = False, str(exc) if isinstance(exc, CheckpointError) \
                    else describe_os_error(exc)
        if not all_agree(env, ok):  # every rank names rank 0's reason (another writer, ...)
            raise CheckpointError(f"cannot create checkpoint directory {tmp}: "
                                  f"{from_main(env, problem) or 'failed on rank 0'}")
    except BaseException:  # refused, Ctrl-C, a lost peer: never keep the root locked
        if lock is not None:
            lock.release()
        raise
    return lock


class PublishedError(OSError):
    """A failure after the checkpoint's rename: it is published, what followed is not done."""


#: written into a directory being deleted, right after its rename to ``.trash.*``: what
#: tells the next save's sweep that the directory is shardwise's own
TRASH_MARK = ".shardwise-trash"
#: the files a save writes into its hidden ``.tmp.*`` directory (DCP's shards and metadata,
#: the record, the manifest, the RNG folder, DeepSpeed's folder, each while written too)
_TMP_FILES = re.compile(r"(__\d+_\d+\.distcp|\.metadata|shardwise\.json|checksums\.json"
                        r"|deepspeed|zero_to_fp32\.py|zero_to_torch\.py)(\.tmp)?")
_RNG_FILES = re.compile(r"rank_\d{5,}\.json(\.tmp)?")
#: the Trainer's own layout: a checkpoint-N it wrote records its state here
TRAINER_STATE = "trainer_state.json"
_TRASH_NAME = re.compile(re.escape(TRASH) + r".+\.[0-9a-f]{8}")


def retire(path: Path) -> None:
    """Delete the directory ``path``: one rename out of the published names, marked as
    shardwise's, then its contents, the mark last (a crash leaves it recognisable)."""
    trash = path.with_name(f"{TRASH}{path.name}.{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    _delete(trash)


def _delete(trash: Path) -> None:
    """Delete ``trash``'s contents, then its mark, then itself: the mark goes only once
    nothing else is left, so whatever a crash or an undeletable file leaves stays
    recognisable as shardwise's (the next save tries again)."""
    mark_file = trash / TRASH_MARK
    with contextlib.suppress(OSError):
        mark_file.touch()
    for entry in trash.iterdir():
        if entry.name == TRASH_MARK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    if any(entry.name != TRASH_MARK for entry in trash.iterdir()):
        return
    with contextlib.suppress(OSError):
        mark_file.unlink(missing_ok=True)
        trash.rmdir()


def real_dir(path: Path) -> bool:
    """Whether ``path`` is a folder and not a symlink to one."""
    return path.is_dir() and not path.is_symlink()


def _sealed(path: Path) -> bool:
    """A real directory holding a regular ``checksums.json``: every checkpoint shardwise
    publishes (``sw.save``'s and the Trainer's) is sealed with one."""
    manifest = path / MANIFEST
    return real_dir(path) and manifest.is_file() and not manifest.is_symlink()


def _published_as(path: Path, name: str) -> bool:
    """Whether the real directory ``path`` is a checkpoint shardwise published as ``name``: a
    complete one whose record names it (older records: a step name), or, without a record,
    the Trainer's layout (its seal, or its ``trainer_state.json``)."""
    if not real_dir(path):
        return False
    if not os.path.lexists(path / META):
        return _sealed(path) or (path / TRAINER_STATE).is_file()
    if not is_complete(path):
        return False
    try:
        recorded = read_json(path / META, follow=False).get("name")
    except (OSError, ValueError, AttributeError):
        return False
    return recorded == name or (recorded is None and is_step_name(name))


def _ours_old(old: Path) -> bool:
    """``.old.X``: a checkpoint shardwise published as ``X`` and set aside for a re-save."""
    return _published_as(old, old.name.removeprefix(OLD))


def _ours_tmp(tmp: Path, nested: bool) -> bool:
    """``.tmp.X``: an interrupted save's directory, holding only what a save writes (the
    RNG folder only rank files), or nothing yet; with ``nested`` (a caller sweeping its own
    pattern, the Trainer's ``checkpoint-*``), its staged ``X`` folder too."""
    if not real_dir(tmp):
        return False
    inner = tmp.name.removeprefix(TMP)

    def ours(entry: Path) -> bool:
        if entry.name == "rng":
            return real_dir(entry) and all(_RNG_FILES.fullmatch(f.name) for f in entry.iterdir())
        return bool(_TMP_FILES.fullmatch(entry.name)) or (
            nested and entry.name == inner and real_dir(entry))

    return all(ours(entry) for entry in tmp.iterdir())


def _ours_trash(trash: Path) -> bool:
    """``.trash.X.<8 hex>``: a directory :func:`retire` was deleting (its mark, or a seal,
    or nothing left)."""
    return real_dir(trash) and _TRASH_NAME.fullmatch(trash.name) is not None and (
        (trash / TRASH_MARK).is_file() or _sealed(trash) or not any(trash.iterdir()))


def _replaceable(path: Path) -> bool:
    """Whether ``path`` is a checkpoint shardwise published under its name (a save of the
    same name may replace it), or the Trainer's own ``checkpoint-N``; never a symlink."""
    return _published_as(path, path.name)


def _check_in_the_way(root: Path, name: str) -> None:
    """Refuse to save ``name`` over what shardwise did not write: a user's folder or file
    called ``name`` (a re-save replaces only a checkpoint of its own), or a ``.old.name``
    the sweep left as not its own (it would be where the old checkpoint is set aside)."""
    final, aside = root / name, root / (OLD + name)
    if os.path.lexists(final) and not _replaceable(final):
        raise CheckpointError(
            f"{final} exists and is not a checkpoint shardwise saved under this name (a "
            "symlink, a file, or a folder without its record and seal); saving would replace "
            "it. Move it away or save under another name")
    if os.path.lexists(aside):
        raise CheckpointError(
            f"{aside} is in the way: a re-save sets the checkpoint it replaces aside under "
            "that name, and this one is not shardwise's. Move it away")


def recover(root: Path, names: str = "*") -> None:
    """Put back or clear what interrupted saves of checkpoints called ``names`` (a glob) left
    in ``root`` (the writer's lock held). Only what shardwise itself wrote is touched,
    recognised by its content: a user's own ``.tmp.notes`` or ``.old.data/`` stays."""
    for old in root.glob(OLD + names):
        if not _ours_old(old):
            continue
        published = old.with_name(old.name.removeprefix(OLD))
        if os.path.lexists(published):
            retire(old)  # the re-save was published: this is the copy it replaced
        else:
            os.rename(old, published)  # killed between the two renames: the old one returns
    for debris in root.glob(TMP + names):
        if _ours_tmp(debris, nested=names != "*"):
            shutil.rmtree(debris, ignore_errors=True)
    for debris in root.glob(TRASH + "*"):
        if _ours_trash(debris):
            _delete(debris)
    fsync_dir(root)


def check_written(tmp: Path, sizes: dict[str, int]) -> None:
    """Raise ``OSError`` unless every file the ranks reported is in ``tmp``, a regular file
    of the reported size (a file lost or cut short since it was hashed)."""
    for name, size in sorted(sizes.items()):
        info = os.lstat(tmp / name)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise OSError(f"{tmp / name} is not the {size}-byte file that was written "
                          f"(now {info.st_size} bytes, mode {stat.filemode(info.st_mode)})")


def seal_and_publish(root: Path, tmp: Path, final: Path, step: int, keep_last: int | None,
                     world_size: int, written: Written, own: str | None = None) -> None:
    """Rank 0, once every rank's files are written: the manifest of what the checkpoint
    needs (from what the ranks reported), then :func:`publish`.

    Raises:
        PublishedError: after the rename (the checkpoint is published).
        OSError: before it (nothing is published).
    """
    manifest, sizes = manifest_of(tmp, world_size, written, own)
    write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
    publish(root, tmp, final, step, keep_last, sizes, point_latest=is_step_name(final.name))


def publish(root: Path, tmp: Path, final: Path, step: int, keep_last: int | None,
            sizes: dict[str, int], *, point_latest: bool = True) -> None:
    """Verify ``tmp`` and make it visible as ``final``, point ``latest`` at it (unless
    ``point_latest`` is false: a layout that finds its newest checkpoint by name), then prune."""
    check_written(tmp, sizes)
    fsync_dir(tmp)
    old = final.with_name(OLD + final.name)
    replacing = final.exists()
    if replacing:  # the same step saved again: set the published one aside, never delete first
        os.rename(final, old)
        fsync_dir(root)
    os.rename(tmp, final)
    stage = "making it durable"
    try:  # published: what fails from here on must not be reported as "nothing published"
        fsync_dir(root)
        if point_latest:
            stage = f"pointing {LATEST} at it ({LATEST} still names the checkpoint before)"
            write_durably(root / LATEST, final.name + "\n")
            fsync_dir(root)
        stage = "deleting the copy it replaced (the next save does it)"
        if replacing:
            retire(old)
        stage = "deleting older checkpoints for keep_last"
        if keep_last is not None:
            # only checkpoints older than this one: after a rollback, newer-numbered ones
            # belong to an abandoned run and are left for the user to judge
            older = [p for p in complete_steps(root) if step_of(p) < step]
            for old_step in older[:len(older) - (keep_last - 1)]:
                retire(old_step)
    except OSError as exc:
        raise PublishedError(f"checkpoint {final} was published (it loads by its path), but "
                             f"{stage} failed: {exc.strerror or exc}"
                             + (f" ({exc.filename})" if exc.filename else "")) from exc
