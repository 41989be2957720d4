# Env, the frozen record of where this process runs, and detect(), which reads it once.
"""Where we run: :class:`Env` and :func:`detect`."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

import attrs
import torch

from shardwise import precision
from shardwise._text import short as _short
from shardwise.errors import EnvError
from shardwise.precision import Precision

__all__ = ["Env", "detect", "CONFIG_ENV_VAR", "Launcher", "Precision", "variables_hidden"]

Launcher = Literal["none", "torchrun", "env", "slurm", "mpi"]
_LAUNCHERS = get_args(Launcher)

#: The variable a launcher sets to hand a config file to the script (``Env.config_path``).
CONFIG_ENV_VAR = "SHARDWISE_CONFIG_FILE"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _to_timeout(value: object) -> datetime.timedelta:
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value) if abs(value) < 1e300 else math.inf
    else:
        raise EnvError(f"'timeout' must be a datetime.timedelta or seconds (got {_short(value)})")
    if not 0.001 <= seconds <= _MAX_TIMEOUT_S:
        raise EnvError(f"'timeout' must be a finite number of seconds in [0.001, "
                       f"{_MAX_TIMEOUT_S:.0f}] (got {_short(value)})")
    return datetime.timedelta(seconds=seconds)


#: A year: longer is a typo (and far past what a collective should wait); NaN and inf refused.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0


def _to_device(value: object) -> torch.device:
    """A device this build of torch has, named the way torch names it."""
    try:
        device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        raise EnvError(f"'device' must be a torch.device or a name such as 'cpu' or 'cuda:0' "
                       f"(got {_short(value)})") from None
    return device


def check_device(device: torch.device) -> None:
    """Raise :class:`EnvError` unless this machine and build of torch have ``device``."""
    kind = device.type
    if kind == "cpu" or kind == "meta":
        return
    module = getattr(torch, kind, None)
    if module is None or not (hasattr(module, "is_available") and module.is_available()):
        raise EnvError(f"'device'={str(device)!r} is not available: this torch {torch.__version__} "
                       f"has no usable {kind} device; accepted here: 'cpu'"
                       f"{', cuda' if torch.cuda.is_available() else ''}")
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise EnvError(f"'device'={str(device)!r} is not available: this machine has {count} "
                       f"{kind} device(s), {kind}:0 to {kind}:{count - 1}")


def check_topology(values: Mapping[str, Any]) -> None:
    """Raise :class:`EnvError` naming the field unless ranks, sizes and port are in range."""
    defaults = {"world_size": 1, "local_world_size": 1, "num_nodes": 1, "rank": 0,
                "local_rank": 0, "node_rank": 0}
    for name in ("world_size", "local_world_size", "num_nodes"):
        value = values.get(name, defaults[name])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EnvError(f"'{name}' must be an integer >= 1 (got {_short(value)})")
    checks = (("rank", values.get("world_size", 1)),
              ("local_rank", values.get("local_world_size", 1)),
              ("node_rank", values.get("num_nodes", 1)))
    for name, bound in checks:
        value = values.get(name, defaults[name])
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise EnvError(f"'{name}' must be an integer in [0, {bound}) (got {_short(value)})")
    port = values.get("master_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):
        raise EnvError(f"'master_port' must be an integer in [1, 65535] or None (got {_short(port)})")


@attrs.frozen
class Env:
    """Where this process runs. Built by :func:`detect`; reading it changes nothing.

    Example:
        >>> env = sw.detect()
        >>> env.world_size, env.device, env.backend
        (1, device(type='cpu'), 'gloo')
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=_to_device)
    backend: str = "gloo"
    precisions: tuple[Precision, ...] = ("fp32", "bf16")
    device_memory_bytes: int | None = None
    timeout: datetime.timedelta = attrs.field(default=DEFAULT_TIMEOUT, converter=_to_timeout)
    launcher: Launcher = "none"
    config_path: str | None = None
    accelerate_variables: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)
    """The ``ACCELERATE_*``, ``FSDP_*`` and ``PARALLELISM_CONFIG_*`` variables ``accelerate
    launch`` set (name, value), which :func:`shardwise.pipeline` follows like a config file."""
    restart_count: int = 0
    """Which attempt of an elastic job this is (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
    error_file: str | None = None
    """Where torchrun wants a failing rank's error (``TORCHELASTIC_ERROR_FILE``), or None."""
    replica_group: int | None = None
    """This job's replica group under :func:`shardwise.fault_tolerant` (torchft's
    ``REPLICA_GROUP_ID``), or None."""
    replica_groups: int | None = None
    """The replica groups the data is split over (``NUM_REPLICA_GROUPS``), or None."""
    lighthouse: str | None = None
    """torchft's lighthouse address (``TORCHFT_LIGHTHOUSE``), or None."""

    def __attrs_post_init__(self) -> None:
        check_topology(attrs.asdict(self, recurse=False))
        if not isinstance(self.precisions, tuple) or \
                any(p not in precision.NAMES for p in self.precisions):
            raise EnvError(f"'precisions' must be a tuple of {', '.join(map(repr, precision.NAMES))} "
                           f"(got {_short(self.precisions)})")
        for name in ("master_addr", "backend", "config_path", "error_file", "lighthouse"):
            value = getattr(self, name)
            if not isinstance(value, str) and (value is not None or name == "backend"):
                raise EnvError(f"'{name}' must be a str (got {_short(value)})")
        memory = self.device_memory_bytes
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                                   or memory < 0):
            raise EnvError(f"'device_memory_bytes' must be an integer >= 0 or None "
                           f"(got {_short(memory)})")
        for name, low in (("replica_group", 0), ("replica_groups", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise EnvError(f"'{name}' must be an integer >= {low} or None "
                               f"(got {_short(value)})")
        if self.lighthouse is not None and not self.lighthouse.startswith(("http://",
                                                                          "https://")):
            raise EnvError(f"TORCHFT_LIGHTHOUSE={_short(self.lighthouse)} must be the "
                           "lighthouse's http://host:port")
        restart = self.restart_count
        if isinstance(restart, bool) or not isinstance(restart, int) or restart < 0:
            raise EnvError(f"'restart_count' must be an integer >= 0 (got {_short(restart)})")
        if self.launcher not in _LAUNCHERS:
            raise EnvError(f"'launcher' must be one of {_LAUNCHERS} (got {_short(self.launcher)})")

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes shared files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1


def _int(environ: Mapping[str, str], key: str) -> int:
    """Variable ``key`` as an integer: >= 1 for a size or count, >= 0 for a rank or id."""
    raw = environ[key]
    low = 1 if key.endswith(("SIZE", "TASKS", "NODES", "GROUPS")) else 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < low or not raw.strip().lstrip("+").isdigit():
        raise EnvError(f"environment variable {key} must be an integer >= {low} "
                       f"(got {_short(raw)})") from None
    return value


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise EnvError(f"cannot read a host from SLURM node list {_short(nodelist)}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _from_torchrun(environ: Mapping[str, str]) -> dict[str, Any]:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world
    if "GROUP_WORLD_SIZE" in environ:
        nodes = _int(environ, "GROUP_WORLD_SIZE")
    else:
        nodes = max(1, world // local_world)
    node_rank = _int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else (
        _int(environ, "NODE_RANK") if "NODE_RANK" in environ else 0)
    return dict(
        world_size=world, rank=_int(environ, "RANK"), local_rank=_int(environ, "LOCAL_RANK"),
        local_world_size=local_world, num_nodes=nodes, node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
        launcher="torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env",
    )


def expand_task_counts(spec: str) -> list[int]:
    """SLURM's tasks-per-node list, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise EnvError(f"cannot read SLURM tasks per node {_short(spec)}; expected e.g. '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _from_slurm(environ: Mapping[str, str]) -> dict[str, Any]:
    world = _int(environ, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ
                 else "SLURM_NTASKS")
    nodes = _int(environ, "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in environ
                 else "SLURM_NNODES") if ("SLURM_STEP_NUM_NODES" in environ
                                          or "SLURM_NNODES" in environ) else 1
    node_rank = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if spec:
        per_node = expand_task_counts(spec)
        local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    else:
        local_world = max(1, world // nodes)
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST"))
    addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    else:  # the same on every task of the job, and unlikely to clash with another job's
        port = 15000 + _int(environ, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in environ else 29500
    return dict(
        world_size=world, rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
        local_world_size=local_world, num_nodes=nodes, node_rank=node_rank,
        master_addr=addr, master_port=port, launcher="slurm",
    )


def _from_mpi(environ: Mapping[str, str]) -> dict[str, Any]:
    world = _int(environ, "OMPI_COMM_WORLD_SIZE")
    local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE") \
        if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ else world
    rank = _int(environ, "OMPI_COMM_WORLD_RANK")
    nodes = max(1, world // local_world)
    return dict(
        world_size=world, rank=rank,
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
        if "OMPI_COMM_WORLD_LOCAL_RANK" in environ else rank,
        local_world_size=local_world, num_nodes=nodes, node_rank=min(rank // local_world, nodes - 1),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1" if nodes == 1 else None),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500,
        launcher="mpi",
    )


_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _topology(environ: Mapping[str, str]) -> dict[str, Any]:
    present = [k for k in _TORCHRUN_KEYS if k in environ]
    if present:
        missing = [k for k in _TORCHRUN_KEYS if k not in environ]
        if missing:
            raise EnvError(
                f"found {', '.join(present)} but not {', '.join(missing)} in the environment: "
                f"a torchrun-style launch sets all of {', '.join(_TORCHRUN_KEYS)}; set the missing "
                "ones or unset the others")
        return _from_torchrun(environ)
    # only a step started by srun is a distributed job: an sbatch script itself also has
    # SLURM_PROCID=0 and SLURM_NTASKS=N, but no SLURM_STEP_ID
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and "SLURM_STEP_ID" in environ:
        return _from_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        return _from_mpi(environ)
    return {}


def launch_rank(environ: Mapping[str, str] | None = None) -> int:
    """The rank a launcher gave this process (torchrun, srun, mpirun), 0 without one: which
    process says what every process would say (a config's notices), before any group."""
    try:
        return int(_topology(os.environ if environ is None else environ).get("rank", 0))
    except EnvError:  # a broken launch is detect()'s to report
        return 0


def _device_facts(device: torch.device, world_size: int) -> dict[str, Any]:
    """Backend, precisions and memory of ``device``."""
    kind, precisions = device.type, precision.supported(device)
    if kind == "cuda":
        index = device.index or 0
        return dict(backend="nccl", precisions=precisions,
                    device_memory_bytes=torch.cuda.get_device_properties(index).total_memory)
    if kind == "xpu":
        index = device.index or 0
        return dict(backend="xccl", precisions=precisions,
                    device_memory_bytes=torch.xpu.get_device_properties(index).total_memory)
    if kind == "mps":
        return dict(backend="gloo", precisions=precisions, device_memory_bytes=None)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    return dict(backend="gloo", precisions=precisions, device_memory_bytes=ram)


def _pick_device(local_rank: int, world_size: int) -> torch.device:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count == 1:  # one visible device per process (e.g. SLURM's per-task binding)
            return torch.device("cuda", 0)
        if local_rank >= count:
            raise EnvError(f"local rank {local_rank} has no CUDA device: this machine has {count}; "
                           f"start at most {count} processes per node")
        return torch.device("cuda", local_rank)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", local_rank % torch.xpu.device_count())
    if world_size == 1 and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


_MAX_VARIABLE = 4096  # characters; a longer value is not a setting


def accelerate_variables(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The ``ACCELERATE_*``, ``FSDP_*`` and ``PARALLELISM_CONFIG_*`` variables of ``environ``,
    sorted (values bounded)."""
    found = []
    for name in sorted(environ):
        if name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            value = environ[name]
            if len(value) > _MAX_VARIABLE:
                raise EnvError(f"${name} holds {len(value)} characters; a setting holds at most "
                               f"{_MAX_VARIABLE}")
            found.append((name, value))
    return tuple(found)


def _accelerate_cpu(variables: tuple[tuple[str, str], ...]) -> bool:
    """``ACCELERATE_USE_CPU`` as Accelerate reads it (true/yes/1/on)."""
    value = dict(variables).get("ACCELERATE_USE_CPU", "").strip().lower()
    return value in ("1", "true", "yes", "y", "on", "t")


def _elastic(environ: Mapping[str, str]) -> dict[str, Any]:
    """torchrun's attempt number and error file, when it set them."""
    restart = _int(environ, "TORCHELASTIC_RESTART_COUNT") \
        if "TORCHELASTIC_RESTART_COUNT" in environ else 0
    return {"restart_count": restart,
            "error_file": environ.get("TORCHELASTIC_ERROR_FILE") or None}


def _replicas(environ: Mapping[str, str]) -> dict[str, Any]:
    """torchft's variables: the replica group's id, the groups' count, the lighthouse."""
    return {"replica_group": _int(environ, "REPLICA_GROUP_ID")
            if "REPLICA_GROUP_ID" in environ else None,
            "replica_groups": _int(environ, "NUM_REPLICA_GROUPS")
            if "NUM_REPLICA_GROUPS" in environ else None,
            "lighthouse": environ.get("TORCHFT_LIGHTHOUSE") or None}


def detect(*, environ: Mapping[str, str] | None = None, **overrides: Any) -> Env:
    """Read the launcher's variables and the hardware into an :class:`Env`. Changes nothing.

    Reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``/
    ``MASTER_ADDR``/``MASTER_PORT``, else SLURM's (``srun`` without torchrun), else OpenMPI's
    ``OMPI_COMM_WORLD_*``; else it is one process. The config file comes from
    ``$SHARDWISE_CONFIG_FILE``; the settings ``accelerate launch`` hands to the script from
    its ``ACCELERATE_*``, ``FSDP_*`` and ``PARALLELISM_CONFIG_*`` variables
    (``ACCELERATE_USE_CPU`` puts it on the CPU).

    Args:
        environ: variables to read instead of ``os.environ`` (for tests).
        **overrides: any :class:`Env` field, e.g. ``timeout=3600`` (Transformers'
            ``ddp_timeout``, seconds or a timedelta) or ``device="cpu"``. Backend, precisions
            and memory follow an overridden device unless given too.

    Returns:
        The frozen :class:`Env`.

    Raises:
        EnvError: a variable or override is malformed; the message names it.

    Example:
        >>> env = sw.detect(timeout=3600)
        >>> env.timeout.total_seconds()
        3600.0
    """
    fields = attrs.fields_dict(Env)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise EnvError(f"detect() got unknown override(s) {unknown}; accepted: {sorted(fields)}")
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = _topology(environ)
    values.update({k: v for k, v in overrides.items() if k in
                   ("world_size", "rank", "local_rank", "local_world_size", "node_rank",
                    "num_nodes", "master_addr", "master_port", "launcher")})
    check_topology(values)
    variables = accelerate_variables(environ)
    device = overrides.get("device")
    if device is None and _accelerate_cpu(variables):
        device = "cpu"
    if device is None:
        device = _pick_device(values.get("local_rank", 0), values.get("world_size", 1))
    device = _to_device(device)
    check_device(device)
    values.update(_device_facts(device, values.get("world_size", 1)))
    values["device"] = device
    values["config_path"] = environ.get(CONFIG_ENV_VAR) or None
    values["accelerate_variables"] = variables
    values.update(_elastic(environ))
    values.update(_replicas(environ))
    values.update(overrides)
    if isinstance(values.get("precisions"), (list, tuple)):
        values["precisions"] = tuple(values["precisions"])
    return Env(**values)


@contextlib.contextmanager
def variables_hidden(*names: str) -> Iterator[None]:
    """The launcher's variables ``names`` hidden (then put back) while a library that reads
    them itself is set up: shardwise read them once, into the Env and the pipeline, and runs
    what they ask for (Accelerate's state would build a plugin of its own from them)."""
    hidden = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def given_or_detected(env: Env | None, **settings: Any) -> Env:
    """``env`` with ``settings`` (what a config says of the env: device, backend, timeout),
    or, without one, :func:`detect` with them: how an entry point makes its one Env; the
    readers below it take that Env and never detect."""
    if env is None:
        return detect(**settings)
    return attrs.evolve(env, **settings) if settings else env
