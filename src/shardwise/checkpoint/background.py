# Checkpoints that don't stop training: DCP's async_save, published when every rank's files are written.
"""``sw.save(..., blocking=False)``: the state is staged to host memory (DCP's ``async_save``
copies it before returning), the files are written by a background thread, and the
checkpoint is published (checksums, ``step_N``, ``latest``, ``keep_last``) by rank 0 only
after every rank has reported its files written. The ranks report on the rendezvous store,
not with collectives, so the step's collectives and the save's never meet; DCP's own
planning collectives run on a separate gloo group.

At most one save is in flight per process: a new save (blocking or not), ``sw.load`` and
the end of the process wait for it first. A process killed while a save is in flight
leaves ``latest`` naming the previous checkpoint, intact (the new one is still
``.tmp.step_N``, which the next save removes). The root's writer lock, taken by the save
call, is given back by the background thread once the save has ended. A save that failed
and was never waited for makes the process exit with status 1, its cause on stderr.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import functools
import json
import logging
import math
import os
import shutil
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise._text import short
from shardwise.checkpoint import integrity
from shardwise.checkpoint.lock import RootLock
from shardwise.checkpoint.transaction import PublishedError, describe_os_error, seal_and_publish
from shardwise.distributed import joined, side_group
from shardwise.env import Env
from shardwise.errors import ArgumentError, CheckpointError

__all__ = ["AsyncSave", "start", "wait_for_saves", "cause"]

log = logging.getLogger("shardwise.checkpoint")


def _underlying(exc: BaseException) -> BaseException:
    """The rank's own error inside DCP's ``CheckpointException``, else ``exc``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            return failure[0] if isinstance(failure, tuple) else failure
    return exc


def _no_space(exc: BaseException) -> OSError | None:
    """The ``ENOSPC`` error in ``exc``'s chain, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return current
        current = current.__cause__ or current.__context__
    return None


def cause(exc: BaseException, where: Path | None = None) -> str:
    """The underlying error in words: DCP wraps each rank's in a CheckpointException, and
    torch's archive writer reports a full disk as ``inline_container.cc`` text."""
    underlying = _underlying(exc)
    full = _no_space(underlying)
    if full is not None:
        return describe_os_error(full, where)
    text = str(underlying)
    if "inline_container" in text or "file write failed" in text:
        if where is not None and _nearly_full(where):
            return f"no space left on device writing {where}"
        return f"writing a tensor file in {where or 'the checkpoint'} failed ({text[:200]})"
    if isinstance(underlying, OSError):
        return describe_os_error(underlying, where)
    return f"{type(underlying).__name__}: {text}"


def _nearly_full(where: Path) -> bool:
    """Whether the filesystem of ``where`` has under 1 MiB left (after a failed write)."""
    try:
        return shutil.disk_usage(where if where.exists() else where.parent).free < 2**20
    except OSError:
        return False


class AsyncSave:
    """A checkpoint being written in the background; returned by ``sw.save(..., blocking=False)``.

    Example:
        >>> handle = sw.save("checkpoints", bundle, state, blocking=False)
        >>> ...                     # training goes on while the files are written
        >>> path = handle.result()  # published: latest names it
    """

    def __init__(self, final: Path) -> None:
        self.path = final
        self._thread: threading.Thread | None = None  # set by start()
        self._error: str | None = None

    def done(self) -> bool:
        """Whether the save has finished (published, or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Path:
        """Wait for the save; the published checkpoint's directory.

        Raises:
            CheckpointError: the save failed on some rank (nothing was published; ``latest``
                names the previous checkpoint), or ``timeout`` seconds passed.
            ArgumentError: ``timeout`` is not None or a finite number of seconds >= 0.
        """
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout < 0):
            raise ArgumentError(f"AsyncSave.result() 'timeout' must be None or a finite number of "
                                f"seconds >= 0 (got {short(timeout)})")
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.done():
            raise CheckpointError(f"the checkpoint {self.path} is still being written after "
                                  f"{timeout} s")
        _forget(self)
        if self._error is not None:
            raise CheckpointError(self._error)
        return self.path

    def __repr__(self) -> str:
        status = "in flight" if not self.done() else "failed" if self._error else "published"
        return f"AsyncSave({str(self.path)!r}, {status})"


class _InFlight:
    """The one save a process may have in flight, and how many it started (the same count
    on every rank, so their keys on the store match)."""

    def __init__(self) -> None:
        self.handle: AsyncSave | None = None
        self.started = 0
        self.exit_hook = False


_IN_FLIGHT = _InFlight()  # this process's; shared by every bundle, as the store is


def _forget(handle: AsyncSave) -> None:
    if _IN_FLIGHT.handle is handle:
        _IN_FLIGHT.handle = None


def wait_for_saves() -> None:
    """Wait for this process's save in flight, if any.

    Raises:
        CheckpointError: it failed (nothing was published).
    """
    handle = _IN_FLIGHT.handle
    if handle is not None:
        handle.result()


def _wait_at_exit() -> None:
    """At the process's end: wait for the save in flight; one that failed unobserved makes
    the process exit with status 1, its cause on stderr (a lost checkpoint is never silent)."""
    handle = _IN_FLIGHT.handle
    if handle is None:
        return
    log.info("waiting for the checkpoint %s being written before exiting", handle.path)
    try:
        handle.result()
    except CheckpointError as exc:
        log.error("%s", exc)
        print(f"shardwise: a checkpoint written in the background failed and was never waited "
              f"for; exiting with status 1: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def start(env: Env, root: Path, tmp: Path, final: Path, step: int, keep_last: int | None,
          state: dict[str, Any], lock: RootLock | None) -> AsyncSave:
    """Stage ``state`` to host memory and write it into ``tmp`` in the background; rank 0
    publishes it as ``final`` once every rank's files are written. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    distributed = joined(env)
    group = side_group() if distributed else None  # DCP's collectives off the step's group
    _IN_FLIGHT.started += 1
    key = f"shardwise/async_save/{_IN_FLIGHT.started}"
    future: Any = dcp.async_save(state, storage_writer=FileSystemWriter(tmp),
                                 process_group=group, no_dist=not distributed)
    report = _Report(env, key) if distributed else None
    handle = AsyncSave(final)
    handle._thread = threading.Thread(
        target=_finish, name=f"shardwise-save-{final.name}", daemon=False,
        args=(handle, env, root, tmp, final, step, keep_last, future, report, lock))
    _IN_FLIGHT.handle = handle
    if not _IN_FLIGHT.exit_hook:  # registered after the group's own exit: runs before it
        atexit.register(_wait_at_exit)
        _IN_FLIGHT.exit_hook = True
    _destroy_waits_for_saves()
    handle._thread.start()
    return handle


def _destroy_waits_for_saves() -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for this process's save in
    flight first. A script's usual last line destroys every group, the one DCP's background
    collectives run on included: the save then hung or failed and its checkpoint was lost.
    torch has no hook on destroy, so its function is wrapped (once; the wrapper only waits,
    then calls torch's). A failed save is still reported by the exit hook."""
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_waits_for_saves", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        handle = _IN_FLIGHT.handle
        thread = None if handle is None else handle._thread
        every = group is None or group is dist.GroupMember.WORLD  # a sub-group: not the save's
        if every and thread is not None and thread is not threading.current_thread():
            thread.join()  # published (or failed) before its group goes
        original(group)

    destroy_process_group._waits_for_saves = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


class _Report:
    """Each rank's outcome on the rendezvous store, and rank 0's verdict."""

    def __init__(self, env: Env, key: str) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.env, self.key = env, key
        # writing may take long on a large model: the job's own collective timeout, at least
        self.timeout = max(env.timeout, datetime.timedelta(minutes=30))

    def post(self, digests: integrity.Written, error: str | None) -> None:
        value = json.dumps({"digests": digests, "error": error})
        self.store.set(f"{self.key}/rank_{self.env.rank}", value)

    def gather(self) -> list[dict[str, Any]]:
        keys = [f"{self.key}/rank_{r}" for r in range(self.env.world_size)]
        self.store.wait(keys, self.timeout)
        return [json.loads(self.store.get(k)) for k in keys]

    def verdict(self, error: str | None) -> None:
        self.store.set(f"{self.key}/verdict", json.dumps({"error": error}))

    def wait_verdict(self) -> str | None:
        self.store.wait([f"{self.key}/verdict"], self.timeout)
        error: str | None = json.loads(self.store.get(f"{self.key}/verdict"))["error"]
        return error


def _finish(handle: AsyncSave, env: Env, root: Path, tmp: Path, final: Path, step: int,
            keep_last: int | None, future: Future[Any], report: _Report | None,
            lock: RootLock | None) -> None:
    """The background half: wait for this rank's files, report, and on rank 0 publish (then
    give the root's lock back)."""
    try:
        _finish_locked(handle, env, root, tmp, final, step, keep_last, future, report)
    finally:
        if lock is not None:
            lock.release()


def _finish_locked(handle: AsyncSave, env: Env, root: Path, tmp: Path, final: Path, step: int,
                   keep_last: int | None, future: Future[Any], report: _Report | None) -> None:
    error: str | None = None
    digests: integrity.Written = {}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        future.result()
        digests = integrity.digests_of(tmp, env.rank)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        error = f"rank {env.rank}: {cause(exc, tmp)}"
    verdict: str | None = None
    try:
        if report is not None:
            report.post(digests, error)
        if env.is_main:
            outcomes = report.gather() if report is not None else [{"digests": digests,
                                                                   "error": error}]
            verdict = _publish(env, root, tmp, final, step, keep_last, outcomes)
            if report is not None:
                report.verdict(verdict)
        elif report is not None:
            verdict = report.wait_verdict()
    except Exception as exc:  # the store went away (a rank died): nothing is published
        verdict = _unpublished(root, final, f"{type(exc).__name__}: {exc}")
    handle._error = verdict


def _unpublished(root: Path, final: Path, cause_: str) -> str:
    return (f"writing checkpoint {final} in the background failed ({cause_}); "
            f"{root / 'latest'} still names the previous checkpoint")


def _publish(env: Env, root: Path, tmp: Path, final: Path, step: int, keep_last: int | None,
             outcomes: list[dict[str, Any]]) -> str | None:
    """Rank 0: the manifest of every rank's digests and the one-rename publish; None, or
    what went wrong in words (the unpublished files removed)."""
    errors = [o["error"] for o in outcomes if o["error"]]
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        return _unpublished(root, final, "; ".join(errors))
    written = integrity.merged([outcome["digests"] for outcome in outcomes])
    try:
        seal_and_publish(root, tmp, final, step, keep_last, env.world_size, written)
    except PublishedError as exc:
        return str(exc)
    except OSError as exc:
        return _unpublished(root, final, describe_os_error(exc))
    log.info("checkpoint %s published (written in the background)", final)
    return None
