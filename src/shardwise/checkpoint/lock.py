# One writer per checkpoint root: an OS file lock held by rank 0 for the whole of a save.
"""The writer's lock of a checkpoint root.

``root/.shardwise.lock`` is locked with ``flock`` (exclusive) by the rank 0 of the job that
saves, from before it clears debris until the checkpoint is published and pruned; a second
writer waits for it, up to ``WAIT_SECONDS``, then is refused with a ``CheckpointError``
naming the holder (pid, host, since when), which the holder writes into the file.

Why ``flock`` on a file: the kernel releases it when its process dies, however it dies
(SIGKILL included), so a lock left by a dead process needs no recovery of ours; on NFS
(Linux clients emulate ``flock`` with POSIX byte-range locks, served by NLM or NFSv4) a
lock of a dead node is released when its lease expires (NFSv4: about 90 s) or when the
node's ``statd`` reports its restart (NFSv3). Lustre needs the ``flock`` mount option,
which is the default on current releases; a filesystem that refuses locks is an error,
never a silent unlocked save. The file itself is never deleted: deleting a lock file opens
a race where two writers lock two different files.

Two bundles of one process are told apart in the process (``flock`` on NFS follows POSIX
semantics, where a process never conflicts with itself): a root this process is writing
waits the same way.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from shardwise.errors import CheckpointError

__all__ = ["LOCK", "WAIT_SECONDS", "RootLock", "ReadLock", "acquire", "share"]

LOCK = ".shardwise.lock"
#: how long a second writer waits for the first before it is refused
WAIT_SECONDS = 600.0
_POLL = 0.05


class _Writers:
    """The roots this process is writing (their real paths), and a condition to wait on."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.roots: dict[str, str] = {}  # real path -> who holds it, in words


_WRITERS = _Writers()


def _me() -> str:
    return f"pid {os.getpid()} on host {socket.gethostname()}"


class RootLock:
    """A held lock of one checkpoint root; :meth:`release` gives it back (once)."""

    def __init__(self, root: Path, key: str, fd: int) -> None:
        self.root, self._key, self._fd = root, key, fd

    def release(self) -> None:
        """Give the lock back: closing the file releases it in the kernel."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        os.close(fd)
        with _WRITERS.changed:
            _WRITERS.roots.pop(self._key, None)
            _WRITERS.changed.notify_all()

    def __repr__(self) -> str:
        return f"RootLock({str(self.root)!r}, {'held' if self._fd >= 0 else 'released'})"


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it into the file (pid, host, since)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return (f"pid {int(data['pid'])} on host {str(data['host'])[:64]}, saving since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(data['since'])))}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a writer that has not said who it is yet"


def _refused(root: Path, holder: str, wait: float) -> CheckpointError:
    return CheckpointError(
        f"another job is saving to or loading from {root} and did not finish within {wait:g} s "
        f"({root / LOCK}: the last writer was {holder}); one checkpoint root has one writer: "
        "give each job its own directory, or wait for the other job to end")


def _claim_in_process(root: Path, key: str, deadline: float, wait: float) -> None:
    with _WRITERS.changed:
        while key in _WRITERS.roots:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _refused(root, _WRITERS.roots[key], wait)
            _WRITERS.changed.wait(min(left, 1.0))
        _WRITERS.roots[key] = f"{_me()} (this process)"


def _locked(fd: int, operation: int, deadline: float) -> bool:
    """``flock(fd, operation)``, retried until ``deadline``: whether it was taken.

    Raises:
        OSError: the filesystem cannot lock (anything but "held by another").
    """
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)


def _lock_file(root: Path, fd: int, deadline: float, wait: float) -> None:
    try:
        taken = _locked(fd, fcntl.LOCK_EX, deadline)
    except OSError as exc:
        raise CheckpointError(
            f"cannot lock {root / LOCK} ({exc.strerror or exc}): the filesystem does not "
            "support file locks, which keep two writers of one checkpoint root apart; "
            "save to a local disk or a filesystem mounted with locking (NFS with lockd "
            "or NFSv4, Lustre with -o flock)") from None
    if not taken:
        raise _refused(root, _holder(fd), wait)


class ReadLock:
    """A shared lock of a checkpoint root held while a load reads it: a writer's save (and
    its ``keep_last``) waits until the readers are done, and a reader waits for a save."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (once)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def share(root: Path, wait: float | None = None) -> ReadLock | None:
    """Lock ``root`` for reading, waiting up to ``wait`` seconds for a writer to finish; None
    where the root has no lock file (no shardwise save wrote it) or it cannot be opened
    (a read-only copy): then nothing can write there either.

    Raises:
        CheckpointError: a writer kept the root longer than ``wait`` (named).
    """
    wait = WAIT_SECONDS if wait is None else wait
    try:
        fd = os.open(root / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        taken = _locked(fd, fcntl.LOCK_SH, time.monotonic() + wait)
    except OSError:  # a filesystem without locks: nothing to wait for
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        holder = _holder(fd)
        os.close(fd)
        raise _refused(root, holder, wait)
    return ReadLock(fd)


def acquire(root: Path, wait: float | None = None) -> RootLock:
    """Lock ``root`` for one writer, waiting up to ``wait`` seconds (``WAIT_SECONDS``).

    Raises:
        CheckpointError: another writer kept it longer (named), or the filesystem cannot lock.
        OSError: ``root`` cannot be created or the lock file opened.
    """
    wait = WAIT_SECONDS if wait is None else wait
    root.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(root)
    deadline = time.monotonic() + wait
    _claim_in_process(root, key, deadline, wait)
    fd = -1
    try:
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        _lock_file(root, fd, deadline, wait)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with _WRITERS.changed:
            _WRITERS.roots.pop(key, None)
            _WRITERS.changed.notify_all()
        raise
    return RootLock(root, key, fd)
