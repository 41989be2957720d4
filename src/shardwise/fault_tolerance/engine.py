# FaultTolerantEngine: any in-group engine, with its gradients averaged across torchft's quorum.
"""The engine ``fault_tolerant()`` puts in the bundle: the group's own engine, wrapped.

Inside a replica group everything is the wrapped engine's (one process, DDP, FSDP2, tensor
parallel): its wrapper, its reductions, its checkpoints. Across groups, at each window:

1. its first micro-batch joins torchft's quorum (synchronously: a group that must heal has
   done so before it computes anything);
2. its last micro-batch's gradients (each rank's own part: FSDP2's shards, tensor-parallel
   pieces) are averaged over the groups in the quorum with torchft's managed all-reduce,
   one per dtype, the same rank of every group together;
3. ``should_commit()`` asks whether every group of the quorum got there; if not (a group
   was lost in the step) the window is discarded, gradients dropped, nothing applied;
4. else the wrapped engine finishes the window (clipping, the finiteness check, the
   optimizer and scheduler step) on gradients every group now holds alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from shardwise.engines.base import Engine, MemoryParts
from shardwise.engines.step_hooks import Backward, Micro, NoSync, StepRun, WindowEnd
from shardwise.env import Env
from shardwise.errors import FaultToleranceError
from shardwise.fault_tolerance.healing import held_optimizer
from shardwise.fault_tolerance.joining import average, average_parameters, join
from shardwise.state import TrainState

__all__ = ["FaultTolerantEngine", "Replicas"]


@attrs.define(eq=False)
class Replicas:
    """The live side of fault tolerance in one process: torchft's manager and what the
    quorums did so far (read by tests, logs and ``explain()``).

    Attributes:
        manager: torchft's ``Manager`` (None until ``bundle.init()`` or ``sw.load`` joins).
        group: this replica group's id (``REPLICA_GROUP_ID``).
        groups: the replica groups the data is split over.
        state: the training state at the start of the current window: what a healing peer
            is sent with the weights.
        joined: the quorum of the next window was already formed (by the join).
        healed_from: the step this group healed to when it joined, if it healed.
        participants: groups in the last step's quorum.
        discarded: windows whose update the quorum discarded (a group lost mid-step).
        committed: windows every group of their quorum applied.
        timeout: seconds a cross-group all-reduce, ``should_commit`` or a heal may take.
        quorum_timeout: seconds to wait for a quorum.
        hostname: the address this group's manager and checkpoint server advertise.
        callbacks: the state-dict callbacks torchft calls (set at the join).
        store: the TCPStore of a group started without torchrun, kept alive.
        every: local SGD across groups: parameters averaged every this many steps (None:
            gradients every step).
        outer_factory: DiLoCo's outer optimizer, built from the last average's tensors.
        outer: that optimizer, once built; backup: the last average (each rank's parts).
        pending: a healing peer's :meth:`extra_state`, until the outer optimizer exists.
        max_discarded: updates in a row the quorum may discard before the group stops.
        in_a_row: updates discarded since the last committed one.
    """

    group: int
    groups: int
    manager: Any = None
    state: TrainState = attrs.Factory(TrainState)
    joined: bool = False
    healed_from: int | None = None
    participants: int = 0
    discarded: int = 0
    committed: int = 0
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    hostname: str = "localhost"
    callbacks: Any = None
    store: Any = None
    every: int | None = None
    outer_factory: Any = None
    outer: Any = None
    backup: list[torch.Tensor] | None = None
    pending: dict[str, Any] | None = None
    max_discarded: int = 20
    in_a_row: int = 0

    def extra_state(self) -> dict[str, Any]:
        """What a healing peer needs beside the bundle's objects: DiLoCo's last average and
        its outer optimizer's state."""
        if self.outer is None or self.backup is None:
            return {}
        return {"backup": self.backup, "outer": held_optimizer(self.outer)}


@attrs.frozen
class FaultTolerantEngine(Engine):
    """``inner`` (the group's engine) with its data parallelism continued across torchft's
    replica groups: quorum at a window's start, gradients averaged over the quorum, the
    update applied only where torchft commits it.

    Attributes:
        inner: the engine the distribution transform chose inside the group.
        replicas: torchft's manager and the quorums' record, shared by every copy.
        min_replicas: groups a quorum needs before its updates are applied.
    """

    inner: Engine
    replicas: Replicas
    min_replicas: int = 1

    # -- the wrapped engine's answers ---------------------------------------------------------

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.inner.name} across torchft replica groups"

    @property
    def casts_parameters(self) -> bool:  # type: ignore[override]
        return self.inner.casts_parameters

    @property
    def places_parameters(self) -> bool:  # type: ignore[override]
        return self.inner.places_parameters

    @property
    def owns_optimizer(self) -> bool:  # type: ignore[override]
        return self.inner.owns_optimizer

    @property
    def exports_in_place(self) -> bool:  # type: ignore[override]
        return self.inner.exports_in_place

    @property
    def own_checkpoint(self) -> str | None:  # type: ignore[override]
        return self.inner.own_checkpoint

    def __getattr__(self, name: str) -> Any:
        """What only the wrapped engine has (``shard_ranks``, ``world_size``, ...)."""
        if name == "inner":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.inner.unwrap(model)

    def full_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.full_state(model)

    def synchronise_replicas(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                             ) -> None:
        self.inner.synchronise_replicas(model, optimizer)

    @property
    def sharded_optimizer(self) -> torch.optim.Optimizer | None:
        return self.inner.sharded_optimizer

    def with_sharded_optimizer(self, sharded: torch.optim.Optimizer | None) -> Engine:
        return attrs.evolve(self, inner=self.inner.with_sharded_optimizer(sharded))

    def save_own(self, path: Path) -> None:
        self.inner.save_own(path)

    def check_own(self, path: Path) -> None:
        self.inner.check_own(path)

    def load_own(self, path: Path) -> None:
        self.inner.load_own(path)

    @property
    def partial_optimizer(self) -> bool:
        return self.inner.partial_optimizer

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        return self.inner.state_dicts(model, optimizer)

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         loaded: dict[str, Any], other: dict[str, Any]) -> None:
        self.inner.load_state_dicts(model, optimizer, loaded, other)

    def memory(self, model: nn.Module, env: Env, *, trained: set[int],
               optimizer_layout: tuple[float, float], precision_bytes: int,
               accumulating: bool) -> MemoryParts:
        parts = self.inner.memory(model, env, trained=trained, optimizer_layout=optimizer_layout,
                                  precision_bytes=precision_bytes, accumulating=accumulating)
        return attrs.evolve(parts, layout=f"{parts.layout}, per replica group")

    def gradient_ranks(self, env: Env) -> int:
        return self.inner.gradient_ranks(env)

    def syncs_gradients(self) -> bool:
        return self.inner.syncs_gradients()

    def no_sync(self, model: nn.Module, state: TrainState) -> NoSync | None:
        return self.inner.no_sync(model, state)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.inner.local(tensor)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.inner.full(tensor)

    def clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return self.inner.clip(params, max_norm, norm_type)

    def stepping_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.inner.stepping_optimizer(optimizer)

    # -- across replica groups ------------------------------------------------------------------

    def _manager(self) -> Any:
        manager = self.replicas.manager
        if manager is None:
            raise FaultToleranceError(
                "fault_tolerant(): this replica group has not joined torchft's quorum; call "
                "state = bundle.init() (or sw.load(...)) before bundle.step(): a restarted "
                "group heals from a live peer there, before it reads its first batch")
        return manager

    def backward(self, run: StepRun, state: TrainState, batch: Any, micro: Micro) -> Backward:
        if state.window_batches == 0:
            replicas = self.replicas
            replicas.state = state
            if replicas.joined:
                replicas.joined = False  # the join formed this window's quorum
            elif replicas.every is None:
                run.phase = "torchft quorum"
                manager = self._manager()
                replicas.callbacks.healed.clear()
                manager.start_quorum()
                if replicas.callbacks.healed:
                    raise self._fell_behind(state)
            replicas.participants = self._manager().num_participants()
        return self.inner.backward(run, state, batch, micro)

    def end_window(self, run: StepRun, state: TrainState, done: Backward, micro: Micro
                   ) -> WindowEnd:
        manager = self._manager()
        replicas = self.replicas
        if replicas.every is not None:  # local SGD: the group steps alone (after_window)
            return self.inner.end_window(run, state, done, micro)
        run.phase = "all-reduce across torchft replica groups"
        for param in run.params:  # every group sends every gradient, in one layout
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [self.inner.local(p.grad) for p in run.params if p.grad is not None]
        if done.total is not None:  # the items of a weighted window: averaged like gradients
            grads.append(done.total)
        if done.losses is not None and done.losses.is_floating_point():
            grads.append(done.losses)  # a non-finite loss in one group is seen by all
        average(manager, grads)
        run.phase = "torchft should_commit"
        if not manager.should_commit():
            self._discarded(manager)
            run.optimizer.zero_grad(set_to_none=True)
            run.labelled = None
            return WindowEnd(skipped=True)
        replicas.committed += 1
        replicas.in_a_row = 0
        return self.inner.end_window(run, state, done, micro)

    def _discarded(self, manager: Any) -> None:
        """Count a discarded update; past ``max_discarded`` in a row, stop, naming why."""
        replicas = self.replicas
        replicas.discarded += 1
        replicas.in_a_row += 1
        if replicas.in_a_row > replicas.max_discarded:
            failed = manager.errored()
            why = (f"{type(failed.original_exception).__name__}: {failed.original_exception}"
                   if failed is not None else f"fewer than min_replicas={self.min_replicas} "
                   "live groups (is the lighthouse's --min-replicas lower?)")
            raise FaultToleranceError(
                f"replica group {replicas.group}: {replicas.in_a_row} updates in a row were not "
                f"committed (the last: {why}); the data position kept moving without training. "
                "Check the other groups and the lighthouse, or raise max_discarded")

    def after_window(self, run: StepRun, state: TrainState) -> None:
        """Local SGD across groups: every ``every``-th step, a quorum and the average, with
        ``state`` (the finished step's) what a healing peer is sent."""
        replicas = self.replicas
        self.inner.after_window(run, state)
        if replicas.every is None or state.step % replicas.every:
            return
        replicas.state = attrs.evolve(state, pending_check=None)
        run.phase = "averaging across torchft replica groups (local SGD)"
        replicas.callbacks.healed.clear()
        manager = self._manager()
        manager.start_quorum()
        if replicas.callbacks.healed:
            raise self._fell_behind(state)
        replicas.participants = manager.num_participants()
        average_parameters(self, run.model)

    def _fell_behind(self, state: TrainState) -> FaultToleranceError:
        return FaultToleranceError(
            f"replica group {self.replicas.group} fell behind its peers mid-run (an update "
            f"near step {state.step} was discarded where theirs committed) and torchft healed "
            "it from a peer; the batch in hand is from its own position, not the healed one. "
            "Restart the group (torchrun --max-restarts): it heals at bundle.init() and reads "
            "from the peers' data position")

    def begin(self, bundle: Any, state: TrainState) -> TrainState:
        return join(self, bundle, state)

    def describe(self, env: Env) -> str:
        replicas = self.replicas
        what = ("gradients averaged over the groups in each step's quorum" if replicas.every
                is None else f"parameters averaged every {replicas.every} steps (local SGD"
                f"{', DiLoCo outer optimizer' if replicas.outer_factory else ''})")
        return (f"{self.inner.describe(env)}; across torchft replica groups: group "
                f"{replicas.group} of {replicas.groups}, {what} (quorums of at least "
                f"{self.min_replicas}), an average a group was lost in discarded, a restarted "
                "group healed from a live peer at bundle.init()")
