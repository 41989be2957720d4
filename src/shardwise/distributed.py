# Joining and leaving the process group: the only place shardwise calls init_process_group.
"""Process-group set-up for an :class:`~shardwise.env.Env`."""

from __future__ import annotations

import atexit
import datetime
import logging

import torch
import torch.distributed as dist

from shardwise.env import Env
from shardwise.errors import EnvError

__all__ = ["ensure_process_group"]

log = logging.getLogger(__name__)

# How long the exit barrier waits for the other ranks before leaving anyway.
_EXIT_BARRIER = datetime.timedelta(seconds=60)


def _shutdown() -> None:
    """Barrier, then destroy the group: avoids aborts and torch's 'not destroyed' warning."""
    if not dist.is_initialized():
        return
    try:
        work = dist.barrier(async_op=True)
        if work is not None:
            work.wait(_EXIT_BARRIER)
    except Exception as exc:  # another rank is gone: leave anyway
        log.warning("exit barrier failed (%s); destroying the process group", exc)
    dist.destroy_process_group()


def ensure_process_group(env: Env) -> None:
    """Initialise the default process group for ``env`` if it has several ranks. Idempotent.

    Uses ``env.backend`` and ``env.timeout``. A group started here is destroyed cleanly
    (barrier, then ``destroy_process_group``) when the interpreter exits.

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
    dist.init_process_group(
        backend=env.backend, init_method=init_method, world_size=env.world_size,
        rank=env.rank, timeout=env.timeout, device_id=device_id)
    atexit.register(_shutdown)
