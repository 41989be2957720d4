# The environment variables DeepSpeed reads, set from the Env: the one place shardwise writes os.environ.
"""DeepSpeed reads its accelerator and the process's ranks from the environment, not from
arguments; these are set here from the :class:`~shardwise.env.Env` (never overwriting what
the launcher set), so no other module writes ``os.environ``."""

from __future__ import annotations

import os

from shardwise.env import Env

__all__ = ["for_deepspeed_import", "for_deepspeed_ranks"]


def for_deepspeed_import(env: Env) -> None:
    """On a CPU env, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) unless one is set."""
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def for_deepspeed_ranks(env: Env) -> None:
    """torchrun's rank variables from ``env``, where another launcher (srun, mpirun) or none
    started the job."""
    for name, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                        ("LOCAL_RANK", env.local_rank),
                        ("LOCAL_WORLD_SIZE", env.local_world_size)):
        os.environ.setdefault(name, str(value))
