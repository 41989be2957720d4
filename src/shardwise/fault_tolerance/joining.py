# Joining torchft's quorum: the manager, its state-dict callbacks, and healing at the start.
"""Where a replica group meets the others: at ``bundle.init()`` or ``sw.load``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from shardwise.errors import FaultToleranceError
from shardwise.fault_tolerance.healing import (
    held_state,
    local,
    put_back,
    put_back_optimizer,
)
from shardwise.state import TrainState

__all__ = ["join", "average_parameters", "average"]


@attrs.define(eq=False)
class _Callbacks:
    """The objects a heal reads and writes (the final bundle's), and what it brought."""

    bundle: Any
    engine: Any
    healed: list[TrainState] = attrs.Factory(list)

    def held(self) -> dict[str, Any]:
        b, replicas = self.bundle, self.engine.replicas
        held = held_state(b.model, b.optimizer, b.scheduler, b.scaler, replicas.state)
        held["replicas"] = replicas.extra_state()
        return held

    def put_back(self, held: dict[str, Any]) -> None:
        b = self.bundle
        try:
            self.healed.append(put_back(held, b.model, b.optimizer, b.scheduler, b.scaler))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FaultToleranceError(
                f"healing from a peer replica group: its state is malformed ({type(exc).__name__}: "
                f"{exc}); every group must run this shardwise on the same model") from exc
        self.engine.replicas.pending = held.get("replicas") or None


def _store(env: Any, replicas: Any) -> tuple[str, int]:
    """The group's TCPStore (the launcher's, at MASTER_ADDR:MASTER_PORT); one process
    started without a launcher gets one of its own on 127.0.0.1."""
    if env.master_addr and env.master_port:
        return env.master_addr, env.master_port
    if env.is_distributed:
        raise FaultToleranceError("fault_tolerant(): MASTER_ADDR and MASTER_PORT are not set; "
                                  "start each replica group with torchrun")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    replicas.store = store  # kept alive for the manager's lifetime
    return "127.0.0.1", store.port


def weights_only_transport(timeout: timedelta, hostname: str) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends with torch's
    ``weights_only`` unpickler (torchft's own reads with the full one, which runs any code a
    forged peer sends): tensors, numbers, strings and containers only, which is all
    :func:`~shardwise.fault_tolerance.healing.held_state` sends. Its address names
    ``hostname`` (torchft's names the host's own name, which other machines may not resolve)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def address(self) -> str:  # the address the groups reach each other at
            port = self._server.socket.getsockname()[1]
            return f"http://{hostname}:{port}/checkpoint/"

    return WeightsOnlyTransport(timeout=timeout, num_chunks=0)


def _start(engine: Any, callbacks: _Callbacks) -> Any:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    replicas, env = engine.replicas, callbacks.bundle.env
    lighthouse = env.lighthouse
    if env.rank == 0 and not lighthouse:
        raise FaultToleranceError(
            "fault_tolerant(): TORCHFT_LIGHTHOUSE is not set; start a lighthouse (shardwise "
            "lighthouse --port 29510 --min-replicas 1) and set TORCHFT_LIGHTHOUSE="
            "http://<its host>:29510 for every replica group")
    addr, port = _store(env, replicas)
    timeout = timedelta(seconds=replicas.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=engine.min_replicas, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=replicas.quorum_timeout), connect_timeout=timeout,
        rank=env.rank, world_size=env.world_size, store_addr=addr, store_port=port,
        lighthouse_addr=lighthouse, replica_id=f"shardwise_{replicas.group}",
        hostname=replicas.hostname, checkpoint_transport=weights_only_transport(timeout, replicas.hostname))
    manager.register_state_dict_fn("shardwise", callbacks.put_back, callbacks.held)
    return manager


def join(engine: Any, bundle: Any, state: TrainState) -> TrainState:
    """Join the quorum with ``state`` (a fresh one, or a checkpoint's); where the quorum's
    peers are ahead, heal from one of them and return its state, the loader positioned at its
    data position.

    Raises:
        FaultToleranceError: no lighthouse address, or a peer's state that does not fit.
    """
    replicas = engine.replicas
    replicas.state = state
    callbacks = replicas.callbacks
    if callbacks is None:
        callbacks = replicas.callbacks = _Callbacks(bundle, engine)
        replicas.manager = _start(engine, callbacks)
    else:  # joined before (init, then load): the state given replaces this group's, so the
        # quorum must compare it anew: from step 0, the peers ahead heal it
        replicas.manager.load_state_dict({"step": 0, "batches_committed": 0})
    callbacks.bundle = bundle
    callbacks.healed.clear()
    try:
        replicas.manager.start_quorum()
    except FaultToleranceError:
        raise
    except Exception as exc:  # torchft's quorum timeout, or a heal that failed to apply
        raise FaultToleranceError(
            f"replica group {replicas.group} could not join torchft's quorum within "
            f"quorum_timeout={replicas.quorum_timeout} s ({type(exc).__name__}: {exc}); under "
            "local SGD a restarted group waits for its peers' next average: make quorum_timeout "
            "longer than the time between averages") from exc
    failed = replicas.manager.errored()
    if failed is not None:  # e.g. the peer's state could not be fetched or read
        raise FaultToleranceError(
            f"replica group {replicas.group} could not join torchft's quorum: "
            f"{type(failed.original_exception).__name__}: {failed.original_exception}; "
            "nothing was trained. Its launcher restarts it (torchrun --max-restarts)")
    replicas.participants = replicas.manager.num_participants()
    if replicas.every is None:
        replicas.joined = True  # the first window's quorum
    else:  # local SGD: the peers average right after this quorum, and so does the group
        _outer(replicas, bundle.model)
        # a group that just healed holds its source's parameters: it joins the average
        # with no weight, so the others' is not biased towards that source
        average_parameters(engine, bundle.model, weight=0.0 if callbacks.healed else 1.0)
    if not callbacks.healed:
        return state
    healed = callbacks.healed[-1]
    replicas.healed_from = healed.step
    resume = getattr(bundle.loader, "resume", None)
    if resume is not None:
        resume(healed.epoch, healed.batch_in_epoch)
    return healed


def _outer(replicas: Any, model: Any) -> None:
    """DiLoCo's outer optimizer over a copy of the parameters (the last average), built once;
    a healing peer's copy and optimizer state put in it."""
    if replicas.outer_factory is None:
        return
    if replicas.outer is None:
        replicas.backup = [local(p.detach()).clone() for p in model.parameters()]
        replicas.outer = replicas.outer_factory(replicas.backup)
    pending, replicas.pending = replicas.pending, None
    if pending:
        if len(pending["backup"]) != len(replicas.backup):
            raise FaultToleranceError(
                f"healing from a peer replica group: its DiLoCo average holds "
                f"{len(pending['backup'])} tensors, this group's {len(replicas.backup)}; every "
                "group must run the same model")
        for mine, theirs in zip(replicas.backup, pending["backup"], strict=True):
            mine.copy_(theirs)
        put_back_optimizer(pending["outer"], replicas.outer)


def average(manager: Any, tensors: list[Any], weight: float | None = None) -> None:
    """Average ``tensors`` over the quorum's groups in place: one managed all-reduce per
    dtype and device, through a flat buffer. With ``weight``, a weighted mean (a group of
    weight 0 takes the others' mean and adds nothing to it): the weight travels in the same
    buffer, summed. A failed all-reduce is torchft's to report (the step is then not
    committed)."""
    import torch
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.distributed import ReduceOp

    groups: dict[Any, list[Any]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    pending = []
    for group in groups.values():
        flat = _flatten_dense_tensors(group)
        if weight is None:
            pending.append((group, flat, manager.allreduce(flat)))
            continue
        flat = torch.cat([flat * weight, flat.new_full((1,), weight)])
        pending.append((group, flat, manager.allreduce(flat, reduce_op=ReduceOp.SUM)))
    with torch.no_grad():
        for group, flat, work in pending:
            work.wait()
            if weight is not None:
                flat = flat[:-1] / flat[-1].clamp(min=torch.finfo(flat.dtype).tiny)
            for tensor, mean in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                tensor.copy_(mean)


def average_parameters(engine: Any, model: Any, weight: float = 1.0) -> None:
    """Local SGD's average across the quorum's groups, after its quorum: each rank's part of
    every parameter. Plain: the average where torchft commits it, else the parameters stay
    this group's. DiLoCo: the change since the last average (the pseudo-gradient) averaged,
    the outer optimizer applied to the last average, and the parameters set to the result
    where committed, else back to the last average."""
    import torch

    replicas = engine.replicas
    manager = replicas.manager
    params = [local(p.detach()) for p in model.parameters()]
    if replicas.outer is None:
        means = [p.clone() for p in params]
        average(manager, means, weight)
        if manager.should_commit():
            replicas.committed += 1
            with torch.no_grad():
                torch._foreach_copy_(params, means)
        else:
            replicas.discarded += 1
        return
    backup = replicas.backup
    changes = list(torch._foreach_sub(backup, params))
    average(manager, changes, weight)
    if manager.should_commit():
        replicas.committed += 1
        for tensor, change in zip(backup, changes, strict=True):
            tensor.grad = change
        replicas.outer.step()
        replicas.outer.zero_grad(set_to_none=True)
    else:
        replicas.discarded += 1
    with torch.no_grad():
        torch._foreach_copy_(params, backup)
