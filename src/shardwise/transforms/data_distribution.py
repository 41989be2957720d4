# distribute_data(): each rank reads its share of the data, batches arrive on the device.
"""Data distribution (added by the pipeline when a loader is given)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import attrs

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.data import DeviceLoader, shard_loader
from shardwise.env import Env
from shardwise.errors import ArgumentError, DataError
from shardwise.parallel.mesh import MeshLayout
from shardwise.plan import Plan
from shardwise.transforms._checks import boolean, integer, optional_boolean
from shardwise.transforms.base import Stage, Transform

__all__ = ["DistributeData", "distribute_data"]

Split = Literal["samples", "batches"]


def _split(instance: Any, attribute: Any, value: Any) -> None:
    if value not in ("samples", "batches"):
        raise ArgumentError(f"distribute_data() 'split' must be 'samples' or 'batches' (got "
                            f"{short(value)})")


@attrs.frozen(repr=False)
class DistributeData(Transform):
    """Give each rank its share of the loader's data and deliver batches on the device.

    The loader is rebuilt around a ``DistributedSampler`` with the user's batch_size,
    shuffle, drop_last, collate_fn, num_workers and the rest; ``set_epoch`` is called every
    epoch. Batches are moved in one ``TensorDict`` call and come back in the user's structure.
    The pipeline adds it with defaults when a loader is given.

    Args:
        non_blocking: asynchronous host-to-device copies.
        pin_memory: pin host batches; ``None`` pins only on CUDA.
        seed: the shuffling seed, the same on every rank.
        split: how the epoch's order is dealt to the ranks: ``"samples"`` (rank r reads
            samples r, r + n, ..., as ``DistributedSampler``) or ``"batches"`` (whole
            batches r, r + n, ... with every rank's last batch full, as Accelerate's
            prepared loaders; the Trainer on shardwise uses it). The global batches are the
            same either way; the per-rank batches, and so float rounding, differ.
        global_seed: each epoch's iteration draws its seed from torch's global random
            stream, as a plain or Accelerate-prepared DataLoader does, so dropout and later
            seeded inits draw what they draw there (the Trainer on shardwise does). By
            default the loader has its own generator: a resumed run then draws exactly what
            an uninterrupted one draws.

    Example:
        >>> bundle = sw.pipeline(sw.distribute_data(seed=1))(model, optimizer, loader)
    """

    non_blocking: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    pin_memory: bool | None = attrs.field(default=None, kw_only=True, validator=optional_boolean)
    seed: int = attrs.field(default=0, kw_only=True, validator=integer)
    split: Split = attrs.field(default="samples", kw_only=True, validator=_split)
    global_seed: bool = attrs.field(default=False, kw_only=True, validator=boolean)
    stage: ClassVar[Stage] = Stage.DATA
    factory_name: ClassVar[str] = "distribute_data"

    def pins(self, env: Env) -> bool:
        """Whether batches are pinned: by default only where CUDA is the device."""
        cuda = env.device.type == "cuda"
        if self.pin_memory and not cuda:
            raise DataError(f"{self!r}: pinned memory needs a CUDA device, this env has "
                            f"{env.device}; leave pin_memory=None")
        return cuda if self.pin_memory is None else self.pin_memory

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, pin = bundle.env, self.pins(bundle.env)
        mesh = self.mesh(env, bundle.plan)
        ft = bundle.plan.fault_tolerant
        replica = ft.replica(env) if ft is not None else None

        def distributed(loader: Any, across: tuple[int, int] | None = None
                        ) -> DeviceLoader | None:
            if loader is None:
                return None
            sharded = shard_loader(loader, env, seed=self.seed, pin_memory=pin, mesh=mesh,
                                   split=self.split, global_seed=self.global_seed,
                                   replica=across)
            return DeviceLoader(sharded, env.device, non_blocking=self.non_blocking)

        # across fault_tolerant()'s replica groups only the training data is split: each
        # group evaluates the whole eval set (its metrics are reduced inside the group)
        return attrs.evolve(bundle, loader=distributed(bundle.loader, replica),
                            eval_loader=distributed(bundle.eval_loader), distributor=distributed)

    @staticmethod
    def mesh(env: Env, plan: Plan) -> MeshLayout | None:
        """The mesh whose data ranks split the data: the plan's layout when a pipeline-,
        tensor- or context-parallel block reads each batch (else None: all ranks read
        different shares)."""
        return plan.mesh if plan.copies > 1 else None

    def describe_in(self, env: Env, plan: Plan) -> str:
        mesh = self.mesh(env, plan)
        if mesh is None:
            return self.describe(env)
        copies, shares = mesh.copies, mesh.data_ranks(env.world_size)
        block = " x ".join(f"{name}={size}" for name, size in mesh.dims if name in ("pp", "cp", "tp"))
        return (f"DistributedSampler over the {shares} data ranks: each {block} block "
                f"of {copies} reads the same 1/{shares} (checked at the first step), seed "
                f"{self.seed}, set_epoch every epoch; {self._move(env)}")

    def describe(self, env: Env) -> str:
        split = (", whole batches in turn (Accelerate's split)" if self.split == "batches" else
                 ", a sample at a time (Accelerate deals whole batches: the same global batches, "
                 "other per-rank ones; split='batches' gives its)")
        share = (f"DistributedSampler: each of {env.world_size} ranks reads 1/{env.world_size}"
                 f"{split}" if env.is_distributed else "sampler order fixed by seed")
        return f"{share}, seed {self.seed}, set_epoch every epoch; {self._move(env)}"

    def _move(self, env: Env) -> str:
        if env.device.type == "cpu":
            return "batches stay on the CPU (no transfer)"
        return (f"batches moved to {env.device} in one TensorDict call"
                f"{', pinned' if self.pins(env) else ''}"
                f"{', non_blocking' if self.non_blocking else ''}")


#: the public factory: the class itself, so its defaults are written once
distribute_data = DistributeData
