# The checkpoint directory: durable writes, atomic publishing, which checkpoints are shardwise's.
"""Directory layout of checkpoints: ``root/step_NNNNNNNN/`` published by one rename,
``root/latest`` naming the newest, ``keep_last`` pruning only what shardwise published."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["META", "FORMAT", "TORCH_FORMAT", "MANIFEST", "LATEST", "OLD", "write_durably",
           "is_step_name", "check_name", "named", "is_ours",
           "fsync_dir", "is_complete", "incomplete_parts", "complete_steps", "candidates",
           "latest_checkpoint", "open_regular", "read_json", "RNG", "rng_file", "step_of"]

log = logging.getLogger("shardwise.checkpoint")

META = "shardwise.json"
#: the version of shardwise.json's layout this release writes and reads
FORMAT = 1
#: shardwise.json's "engine" of a DCP checkpoint (the native engines)
TORCH_FORMAT = "torch"
MANIFEST = "checksums.json"  # see integrity.py
LATEST = "latest"
RNG = "rng"  # the directory of each rank's generator states
#: the prefix of a published checkpoint moved aside while the same step is saved again
OLD = ".old."


def rng_file(checkpoint: Path, rank: int) -> Path:
    """Where ``rank``'s generator states are in ``checkpoint``."""
    return checkpoint / RNG / f"rank_{rank:05d}.json"


_MAX_JSON_BYTES = 16 * 2**20  # what shardwise writes is far smaller


def _open_below(path: Path, below: Path) -> int:
    """``path`` opened (non-blocking) through no symlink from ``below`` down."""
    parts = path.relative_to(below).parts
    directory = os.open(below, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=directory)
    finally:
        os.close(directory)


def open_regular(path: Path, *, follow: bool = True, below: Path | None = None) -> IO[bytes]:
    """``path`` opened for reading, when it is (or, with ``follow``, links to) a regular file.

    With ``follow=False`` no component from ``below`` (default: the file's directory) down
    may be a symlink.

    Raises:
        OSError: it is missing, unreadable, a directory, a FIFO or a device (or a symlink,
            ``errno.ELOOP``); opening never blocks (a FIFO would wait for a writer,
            ``/dev/zero`` never ends).
    """
    if follow:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    else:
        fd = _open_below(path, below if below is not None else path.parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, limit: int = _MAX_JSON_BYTES, *, follow: bool = True) -> Any:
    """``path`` parsed as JSON.

    Raises:
        OSError: as :func:`open_regular`.
        ValueError: larger than ``limit`` bytes, or not JSON.
    """
    with open_regular(path, follow=follow) as stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply") from None


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, flushed to disk, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the folders an engine with its own checkpoint format writes instead of DCP's files
OWN_FORMATS = ("deepspeed",)


def _tensors_written(path: Path) -> bool:
    """DCP's ``.metadata``, or the folder of an engine's own format, is there."""
    return (path / ".metadata").is_file() or any(
        (path / name).is_dir() and not (path / name).is_symlink() for name in OWN_FORMATS)


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and _tensors_written(path)


def incomplete_parts(path: Path) -> list[str]:
    """When ``path`` holds some of a checkpoint's own files but is not complete, the missing
    ones (``shardwise.json``, DCP's ``.metadata``: a file that is a directory, a FIFO or a
    dangling link is missing); else []."""
    if not any(os.path.lexists(path / name) for name in (META, ".metadata", MANIFEST,
                                                          *OWN_FORMATS)):
        return []
    missing = [str(path / META)] if not (path / META).is_file() else []
    return missing + ([] if _tensors_written(path) else [str(path / ".metadata")])


_STEP_NAME = re.compile(r"step_\d{8,}")  # 8 digits, more from step 100,000,000 on


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a step checkpoint's (``step_NNNNNNNN``)."""
    return _STEP_NAME.fullmatch(name) is not None


def check_name(name: object, where: str) -> str:
    """``name`` when it can name a checkpoint beside the step checkpoints of a root.

    Raises:
        ValueError: naming the value and what is accepted.
    """
    if not isinstance(name, str) or _NAME.fullmatch(name) is None or name == LATEST \
            or name.startswith((LATEST + ".", "step_")):
        raise ValueError(f"{where} 'name' must be 1-100 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit, and neither 'latest', "
                         f"'latest.*' nor 'step_...' (the names of the step checkpoints and "
                         f"of the marker naming the newest); got {name!r}")
    return name


def named(root: Path, name: str) -> Path:
    """The named checkpoint ``name`` in ``root``: ``root/name``, or its ``.old.`` copy while a
    re-save of it is between its two renames."""
    path = root / name
    moved = root / (OLD + name)
    return moved if not os.path.lexists(path) and is_ours(moved) else path


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint shardwise published under this very name:
    its ``shardwise.json`` records the name (a user's copy, ``step_00000002.bak`` or
    ``step_best``, records another one). Checkpoints from before the name was recorded
    count when their own name is exactly ``step_NNNNNNNN``. ``.old.step_N`` (the published
    step N moved aside by a re-save of it) counts while ``step_N`` does not exist: a crash
    between the re-save's two renames leaves it as step N's checkpoint. A symlink never
    counts (it may lead anywhere)."""
    if path.is_symlink() or not path.is_dir() or not is_complete(path):
        return False
    name = path.name
    if name.startswith(OLD):
        name = name.removeprefix(OLD)
        if os.path.lexists(path.with_name(name)):
            return False
    try:
        recorded = read_json(path / META).get("name")
    except (OSError, ValueError, AttributeError):
        return False
    if recorded is None:
        return _STEP_NAME.fullmatch(name) is not None
    return bool(recorded == name)


def step_of(path: Path) -> int:
    """The step a checkpoint directory's name says (``step_N``, ``.old.step_N``), or -1."""
    try:
        return int(path.name.removeprefix(OLD).removeprefix("step_"))
    except ValueError:
        return -1


def _published(root: Path) -> list[Path]:
    return [*root.glob("step_*"), *root.glob(OLD + "step_*")]


def complete_steps(root: Path) -> list[Path]:
    """The checkpoints shardwise published in ``root``, oldest step first."""
    steps = [p for p in _published(root) if is_ours(p)]
    return sorted(steps, key=step_of)


def candidates(root: Path) -> Iterator[Path]:
    """The checkpoints shardwise published in ``root``, best first: the one ``latest`` names
    (when it is one), then the others, newest step first. Lazy: each ``shardwise.json`` is
    read only when its turn comes, so the common case reads one or two."""
    marked = _marked(root)
    if marked is not None:
        yield marked
    for path in sorted(_published(root), key=step_of, reverse=True):
        if path != marked and is_ours(path):
            yield path


def _marked(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, if the marker is intact, names a checkpoint
    directly in ``root`` and that checkpoint is complete (or, mid re-save, its ``.old.``
    copy is); else None (with a warning)."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    try:
        with open_regular(marker) as stream:
            name = stream.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("ignoring the damaged marker %s (%s); using the newest complete "
                    "checkpoint", marker, exc)
        return None
    if _STEP_NAME.fullmatch(name) is not None:
        for path in (root / name, root / (OLD + name)):
            if is_ours(path):
                return path
    log.warning("ignoring the marker %s: it names %r, not a complete checkpoint in %s; "
                "using the newest complete one", marker, name[:40], root)
    return None


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``directory`` (or ``directory`` itself), or None.

    ``directory/latest`` is followed only to a complete checkpoint directly inside
    ``directory``; a damaged or foreign marker is ignored (with a warning) for the newest
    complete checkpoint.
    """
    root = Path(directory)
    if is_complete(root):
        return root
    return next(candidates(root), None)
