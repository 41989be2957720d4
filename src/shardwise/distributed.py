# Joining and leaving the process group: the only place shardwise calls init_process_group.
"""Process-group set-up for an :class:`~shardwise.env.Env`."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from shardwise.env import Env, detect
from shardwise.errors import CollectiveError, EnvError

__all__ = ["ensure_process_group", "joined", "all_agree", "from_main", "main_process_first",
           "collective_failure", "side_group"]

log = logging.getLogger(__name__)

# How long the exit barrier waits for the other ranks before leaving anyway.
_EXIT_BARRIER = datetime.timedelta(seconds=60)
# How long a rank whose collective failed waits for the others to report theirs.
_PEER_REPORT = datetime.timedelta(seconds=3)


class _Membership:
    """This process's part in process groups: shardwise's one record of module state."""

    def __init__(self) -> None:
        #: groups started here (distinguishes the keys of successive groups in one process)
        self.groups_started = 0
        #: the group started here and its exit-barrier store; None once left
        self.started: tuple[dist.ProcessGroup | None, dist.Store] | None = None
        #: where ranks whose collective failed say where they were (None: no group here)
        self.reports: dist.Store | None = None
        #: a gloo group beside the default one, for collectives a background thread runs
        #: (DCP's async save) so that they never interleave with the step's; made on first use
        self.side: dist.ProcessGroup | None = None
        #: torchrun's error file for this rank (from the Env that started the group)
        self.error_file: str | None = None


_MEMBERSHIP = _Membership()


def _exit_barrier(store: dist.Store, rank: int, world_size: int) -> None:
    """All ranks meet on the rendezvous store; rank 0 (which hosts the store when there is
    no torchrun agent) leaves after the others have left it.

    A gloo barrier here would queue work whose last reference a gloo thread may drop while
    the interpreter is finalizing; that work carries the autograd context of the last DDP
    all-reduce, a Python object, and releasing it then aborts the process.
    """
    from torch.distributed.elastic.utils.store import barrier

    seconds = _EXIT_BARRIER.total_seconds()
    barrier(store, world_size, key_prefix="arrived", barrier_timeout=seconds)
    if rank != 0:
        if store.add("left", 1) == world_size - 1:
            store.set("all_left", "1")
    else:
        store.wait(["all_left"], _EXIT_BARRIER)


def _uncaught() -> BaseException | None:
    """The exception that ended the script, if one did: Python keeps it in ``sys.last_exc``
    (``sys.last_value`` before 3.12) before the exit handlers run, so shardwise needs no
    excepthook of its own."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _record_for_launcher(exc: BaseException, tb: TracebackType | None) -> None:
    """Write torchrun's error file (``$TORCHELASTIC_ERROR_FILE``): its summary then shows
    this exception and when it happened, and names the rank that failed first."""
    path = _MEMBERSHIP.error_file
    if not path or os.path.exists(path):
        return
    import json
    import time
    import traceback

    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as stream:
            json.dump(data, stream)
    except OSError as error:  # the launcher's summary is then less precise, nothing else
        log.warning("could not write the launcher's error file %s: %s", path, error)


def collective_failure(exc: BaseException, where: str) -> CollectiveError | None:
    """A :class:`CollectiveError` naming ``where`` and the ranks that did not report, if
    ``exc`` is a collective that failed (timed out, or a peer went away); else None.

    Every rank whose collective fails says where it was on the rendezvous store, then waits
    a few seconds for the others: a rank that says nothing is stalled or gone, and a rank
    that says something else is somewhere else in the program.
    """
    if not _is_collective_failure(exc) or not dist.is_initialized():
        return None
    rank, size = dist.get_rank(), dist.get_world_size()
    reports = _peer_reports(rank, size, where)
    silent = [r for r in range(size) if r != rank and r not in reports]
    elsewhere = {r: w for r, w in reports.items() if r != rank and w != where}
    parts = [f"rank {rank}: a collective failed at {where}: {_first_line(exc)}"]
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} did not report within "
                     f"{_PEER_REPORT.total_seconds():.0f} s: stalled or gone (the first place to "
                     "look)")
    parts += [f"rank {r} was at {w}" for r, w in sorted(elsewhere.items())]
    if not silent and not elsewhere and size > 1:
        parts.append("every rank reported the same place: a network or peer failure")
    return CollectiveError("; ".join(parts))


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in (
        "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
        "Broken pipe", "NCCL", "ProcessGroup"))


def _first_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return line[:300]


def _peer_reports(rank: int, size: int, where: str) -> dict[int, str]:
    """What each rank that reported within ``_PEER_REPORT`` said (this one included)."""
    import time

    store = _MEMBERSHIP.reports
    if store is None:
        return {}
    try:
        store.set(str(rank), where)
        deadline = time.monotonic() + _PEER_REPORT.total_seconds()
        keys = [str(r) for r in range(size)]
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.05)
        return {r: store.get(str(r)).decode(errors="replace")[:200]
                for r in range(size) if store.check([str(r)])}
    except Exception as error:  # the store's host is gone too: say nothing about the peers
        log.warning("could not compare notes with the other ranks: %s", error)
        return {}


def leave_group() -> None:
    """Leave the group started here: exit barrier, then destroy it. Idempotent; registered
    with atexit. Avoids aborts and torch's 'not destroyed' warning.

    A rank whose script ended with an uncaught exception leaves at once instead: the other
    ranks may be blocked in a collective and never reach the barrier, and the launcher
    (torchrun) stops them as soon as this process has exited with its error.
    """
    if _MEMBERSHIP.started is None:
        return
    group, store = _MEMBERSHIP.started
    _MEMBERSHIP.started = None
    if not dist.is_initialized() or dist.group.WORLD is not group:
        return  # the script destroyed (or replaced) the group itself
    failing = _uncaught()
    if failing is not None:
        _record_for_launcher(failing, failing.__traceback__)
        log.error("rank %d raised %s: leaving at once, without the exit barrier",
                  dist.get_rank(), type(failing).__name__)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # no group teardown: a peer may hold it in a collective; exit with Python's code
        os._exit(130 if isinstance(failing, KeyboardInterrupt) else 1)
    try:
        _exit_barrier(store, dist.get_rank(), dist.get_world_size())
    except Exception as exc:  # another rank is gone: leave anyway
        log.warning("exit barrier failed (%s); destroying the process group", exc)
    dist.destroy_process_group()


def ensure_process_group(env: Env) -> None:
    """Initialise the default process group for ``env`` if it has several ranks. Idempotent.

    Uses ``env.backend`` and ``env.timeout``. A group started here is left cleanly when the
    interpreter exits: the ranks meet on the rendezvous store, then ``destroy_process_group``.

    Raises:
        EnvError: a group already exists with another size or rank, or there is no
            master address to rendezvous at.
    """
    if not env.is_distributed:
        return
    if dist.is_initialized():
        size, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
        if env.backend not in str(backend):
            raise EnvError(f"a process group already exists with backend {backend!r}, but the "
                           f"Env's device {env.device} needs {env.backend!r}; initialise it with "
                           f"{env.backend!r} or let shardwise do it")
        if (size, rank) != (env.world_size, env.rank):
            raise EnvError(
                f"a process group already exists with world_size={size}, rank={rank}, but the "
                f"Env says world_size={env.world_size}, rank={env.rank}; use detect() in this "
                "process, or destroy the existing group first")
        return
    if env.launcher == "torchrun":
        init_method = "env://"  # joins torchrun's own store
    else:
        if not env.master_addr or env.master_port is None:
            raise EnvError(
                f"{env.world_size} processes ({env.launcher}) but no master address/port "
                f"(got master_addr={env.master_addr!r}, master_port={env.master_port!r}); "
                "set MASTER_ADDR and MASTER_PORT, or pass them to detect()")
        init_method = f"tcp://{env.master_addr}:{env.master_port}"
    device_id = env.device if env.device.type in ("cuda", "xpu") else None
    if env.device.type == "cuda":  # DeviceMesh and fully_shard place on the current device
        torch.cuda.set_device(env.device)
    log.info("joining process group: rank %d of %d, backend %s, %s",
             env.rank, env.world_size, env.backend, init_method)
    # the rendezvous init_process_group would do, keeping the store for the exit barrier
    store, _, _ = next(dist.rendezvous(init_method, rank=env.rank, world_size=env.world_size,
                                       timeout=env.timeout))
    store.set_timeout(env.timeout)
    # keys under this attempt of an elastic job and this group of the process: a restarted
    # worker must never read the addresses its dead predecessor left in the agent's store
    record = _MEMBERSHIP
    record.groups_started += 1
    record.error_file = env.error_file
    scope = f"shardwise/{env.restart_count}/{record.groups_started}"
    dist.init_process_group(
        backend=env.backend, store=dist.PrefixStore(f"{scope}/default_pg", store),
        world_size=env.world_size, rank=env.rank, timeout=env.timeout, device_id=device_id)
    _leave_later(scope, store)


def _leave_later(scope: str, store: dist.Store) -> None:
    """Record the default group as the one to leave at exit (``leave_group``, registered once
    per process), its exit barrier and failure reports under ``scope`` in ``store``."""
    record = _MEMBERSHIP
    record.reports = dist.PrefixStore(f"{scope}/failed", store)
    if record.groups_started == 1:
        atexit.register(leave_group)
    record.started = (dist.group.WORLD, dist.PrefixStore(f"{scope}/exit", store))


def leave_at_exit() -> None:
    """Leave the existing default group at interpreter exit as shardwise leaves its own: the
    ranks meet on the group's store, then it is destroyed. For a group another library
    started and leaves standing (the Trainer's: TrainingArguments start it through
    Accelerate's ``PartialState``). Every rank calls it; nothing to do without a group or
    when shardwise already leaves it.
    """
    record = _MEMBERSHIP
    if not dist.is_initialized() or record.started is not None or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    record.groups_started += 1  # the same count on every rank: the keys match
    _leave_later(f"shardwise/adopted/{record.groups_started}", _get_default_store())


def side_group() -> dist.ProcessGroup:
    """A gloo group of all ranks beside the default one, for a background thread's
    collectives (made once, on first use: every rank must call it then)."""
    if _MEMBERSHIP.side is None:
        _MEMBERSHIP.side = dist.new_group(backend="gloo")
    return _MEMBERSHIP.side


def joined(env: Env) -> bool:
    """Whether ``env`` has several ranks and this process is in their group."""
    return env.is_distributed and dist.is_initialized()


def from_main(env: Env, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective: every rank calls it)."""
    if not joined(env):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_agree(env: Env, ok: bool) -> bool:
    """Whether every rank passed ``ok=True`` (a collective: every rank calls it)."""
    if not joined(env):
        return ok
    flag = torch.tensor([1 if ok else 0], device=env.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextlib.contextmanager
def main_process_first(env: Env | None = None, *, local: bool = False) -> Iterator[None]:
    """Run the block on the main process first, then on all the others together.

    For work whose result the others reuse: downloading, tokenising and caching a dataset.
    The main process is global rank 0, or with ``local=True`` each node's local rank 0
    (for a cache on a node's own disk). If the main process raises, the others never start
    the block (the failing rank ends the job). In one process it just runs the block.

    Example:
        >>> with sw.main_process_first():
        ...     dataset = load_and_tokenise()
    """
    env = env or detect()
    if not env.is_distributed:
        yield
        return
    ensure_process_group(env)
    main = env.local_rank == 0 if local else env.is_main
    if not main:
        dist.barrier()  # wait for the main process to finish the block
    yield
    if main:
        dist.barrier()  # let the others start
