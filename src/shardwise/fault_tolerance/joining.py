# Joining torchft's quorum: the manager, its state-dict callbacks, and healing at the start.
"""Where a replica group meets the others: at ``bundle.init()`` or ``sw.load``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from shardwise.errors import FaultToleranceError
from shardwise.fault_tolerance.healing import held_state, put_back
from shardwise.state import TrainState

__all__ = ["join"]


@attrs.define(eq=False)
class _Callbacks:
    """The objects a heal reads and writes (the final bundle's), and what it brought."""

    bundle: Any
    engine: Any
    healed: list[TrainState] = attrs.Factory(list)

    def held(self) -> dict[str, Any]:
        b = self.bundle
        return held_state(b.model, b.optimizer, b.scheduler, b.scaler, self.engine.replicas.state)

    def put_back(self, held: dict[str, Any]) -> None:
        b = self.bundle
        self.healed.append(put_back(held, b.model, b.optimizer, b.scheduler, b.scaler))


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
        hostname=replicas.hostname)
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
    callbacks.bundle = bundle
    callbacks.healed.clear()
    replicas.manager.start_quorum()
    replicas.joined = True
    replicas.participants = replicas.manager.num_participants()
    if not callbacks.healed:
        return state
    healed = callbacks.healed[-1]
    replicas.healed_from = healed.step
    resume = getattr(bundle.loader, "resume", None)
    if resume is not None:
        resume(healed.epoch, healed.batch_in_epoch)
    return healed
