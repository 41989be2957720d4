# Distributed, device-placed loading: a DistributedSampler loader and one-call batch transfer.
"""Data distribution and device transfer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from shardwise.env import Env
from shardwise.errors import DataError
from shardwise.parallel.mesh import MeshLayout, data_share

__all__ = ["DeviceLoader", "ResumableSampler", "to_device", "shard_loader", "same_batch"]


class ResumableSampler(DistributedSampler[Any]):
    """A ``DistributedSampler`` that can start an epoch part-way, at a global ``cursor``.

    The epoch's order is one permutation of the dataset (from the seed and the epoch, never
    from the world size); the ranks read it in turns, so after any number of whole global
    batches the samples read are exactly its first ``cursor``. Resuming at ``cursor`` splits
    the rest of the permutation over this sampler's ranks, however many there are and
    whatever their batch size: every remaining sample is read once. Like
    ``DistributedSampler``, the share is made even by repeating samples from the epoch's
    start (or, with ``drop_last``, by dropping the last few). With the ranks and the batch
    size of the save this is exactly the rest of the uninterrupted epoch.

    ``chunk`` is how many consecutive samples of the order a rank takes in its turn: 1 is
    ``DistributedSampler``'s split (rank r reads samples r, r + n, ...); the batch size is
    Accelerate's (rank r reads whole batches r, r + n, ... of the order, and the order is
    padded to whole global batches, so every rank's last batch is full).
    """

    cursor = 0

    def __init__(self, *args: Any, chunk: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk = chunk
        self.total_size = self._padded(len(self.dataset))  # type: ignore[arg-type]
        self.num_samples = self.total_size // self.num_replicas

    def _padded(self, count: int) -> int:
        """``count`` samples made a whole number of turns of every rank (up, or down with
        ``drop_last``)."""
        unit = self.num_replicas * self.chunk
        return count // unit * unit if self.drop_last else -(-count // unit) * unit

    def _order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        return list(range(len(self.dataset)))  # type: ignore[arg-type]

    def remaining(self, cursor: int | None = None) -> int:
        """Samples this rank reads in the epoch from ``cursor`` (default: its own) on."""
        start = self.cursor if cursor is None else cursor
        rest = max(0, len(self.dataset) - start)  # type: ignore[arg-type]
        return self._padded(rest) // self.num_replicas

    def position(self, local: int, rank: int | None = None) -> int:
        """Where the ``local``-th sample of the epoch of ``rank`` (default: this sampler's)
        sits in the padded order."""
        turn, within = divmod(local, self.chunk)
        return (turn * self.num_replicas + (self.rank if rank is None else rank)) * self.chunk \
            + within

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        rest = order[self.cursor:]
        total = self._padded(len(rest))
        if total <= len(rest):
            rest = rest[:total]
        else:
            pad = total - len(rest)
            rest += (order * -(-pad // max(1, len(order))))[:pad]
        return iter([rest[self.position(i)] for i in range(total // self.num_replicas)])

    def __len__(self) -> int:
        return self.remaining()


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = True) -> Any:
    """Move every tensor in ``batch`` to ``device`` in one TensorDict call; keep its structure.

    Dicts, lists, tuples and namedtuples nest freely; other objects with a ``.to`` method
    (e.g. Transformers' ``BatchEncoding``) are moved with it; anything else is left alone.
    """
    leaves, spec = tree_flatten(batch)
    tensors = {str(i): leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    if tensors and any(t.device != device for t in tensors.values()):
        # imported here: tensordict pulls in torch._dynamo (over a second), and only a
        # transfer needs it
        from tensordict import TensorDict

        moved = TensorDict(tensors, batch_size=[]).to(device, non_blocking=non_blocking)
        for key, value in moved.items():
            leaves[int(key)] = value
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and callable(getattr(leaf, "to", None)):
            leaves[i] = leaf.to(device)
    return tree_unflatten(leaves, spec)


class DeviceLoader:
    """Iterates a loader, calling ``set_epoch`` each epoch and moving batches to the device.

    It reads like the loader it wraps: ``len``, ``dataset``, ``batch_size``, ``sampler`` and
    the rest are the wrapped loader's (``sampler`` is this rank's ``DistributedSampler``).

    ``epoch`` is the epoch being iterated and ``batch_in_epoch`` the batches handed out in
    it; :meth:`set_epoch` chooses the epoch the next iteration starts.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device, *,
                 non_blocking: bool = True) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.epoch = 0
        self.batch_in_epoch = 0
        self._next_epoch = 0
        self._resume_at = 0  # batches of the next epoch already consumed before a resume
        self._resume_cursor = 0  # and the samples of its order read by every rank together
        self._base = (0, 0)  # (batch_in_epoch, cursor) where this epoch's iteration began
        self._pending = False  # a resume() whose epoch has not begun iterating yet
        generator = getattr(loader, "generator", None)
        # the base of the per-epoch seeds of the loader's generator (the user's seed, if any)
        self._generator_seed = generator.initial_seed() if generator is not None else 0
        # batches on the CPU are already where they belong: no transfer at all
        self._move = device.type != "cpu"

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (for resuming)."""
        self._next_epoch = epoch

    def _batch_size(self) -> int:
        return getattr(self.loader, "batch_size", None) or 1

    def _batches(self, samples: int) -> int:
        """Batches this rank's loader makes of ``samples`` (its drop_last counted)."""
        size = self._batch_size()
        return samples // size if getattr(self.loader, "drop_last", False) else -(-samples // size)

    def cursor(self, epoch: int, batch_in_epoch: int) -> int | None:
        """The samples of epoch ``epoch``'s order read by every rank together after this rank
        handed out ``batch_in_epoch`` batches of it (None: the sampler is not shardwise's)."""
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):
            return None
        if self._pending and epoch == self._next_epoch:
            first_batch, first_cursor = self._resume_at, self._resume_cursor  # not begun yet
        elif epoch == self.epoch:
            first_batch, first_cursor = self._base
        else:
            first_batch, first_cursor = 0, 0
        read = first_cursor + (batch_in_epoch - first_batch) * self._batch_size() \
            * sampler.num_replicas
        return max(0, min(read, len(sampler.dataset)))  # type: ignore[arg-type]

    def plan_resume(self, epoch: int, batch_in_epoch: int, cursor: int | None = None,
                    samples: int | None = None, shuffle: bool | None = None
                    ) -> tuple[int, int, int]:
        """Where a resume at (epoch, batch_in_epoch, global cursor) continues here:
        (epoch, this rank's batch_in_epoch, cursor); the end of an epoch is (E + 1, 0, 0).
        A record without a cursor was saved with this loader's ranks and batch size.
        Changes nothing.

        Raises:
            DataError: mid-epoch, and the sampler cannot start part-way, or the dataset's
                length or the shuffling is not the saved one.
        """
        if not batch_in_epoch and not cursor:
            return epoch, 0, 0
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):
            raise DataError(
                f"cannot resume mid-epoch (batch {batch_in_epoch} of epoch {epoch}): the "
                f"loader's sampler is a {type(sampler).__name__}, which cannot start "
                "part-way; let shardwise build the sampler (shuffle=True/False), or save at "
                "epoch ends")
        size = len(sampler.dataset)  # type: ignore[arg-type]
        if samples is not None and samples != size:
            raise DataError(
                f"the checkpoint was saved part-way through an epoch of a {samples}-sample "
                f"dataset, this loader's dataset has {size} samples: the epoch's order would "
                "differ, so the samples left cannot be found; resume with the same dataset")
        if shuffle is not None and shuffle != sampler.shuffle:
            raise DataError(
                f"the checkpoint was saved part-way through an epoch read with shuffle={shuffle}, "
                f"this loader has shuffle={sampler.shuffle}: the epoch's order would differ, so "
                "the samples left cannot be found; resume with the same shuffle, or at an "
                "epoch end")
        if cursor is None:
            cursor = batch_in_epoch * self._batch_size() * sampler.num_replicas
        left = self._batches(sampler.remaining(cursor))
        length = self.epoch_length()
        if left == 0 or length is None:
            return epoch + 1, 0, 0
        return epoch, max(0, length - left), cursor

    def resume(self, epoch: int, batch_in_epoch: int, cursor: int | None = None) -> None:
        """Make the next iteration continue epoch ``epoch`` at the global ``cursor`` (default:
        after ``batch_in_epoch`` batches of this loader's ranks and batch size), counting
        from ``batch_in_epoch``.

        The sampler starts part-way through the epoch's permutation; no sample is re-read.

        Raises:
            DataError: the loader's sampler cannot start mid-epoch.
        """
        epoch, done, cursor = self.plan_resume(epoch, batch_in_epoch, cursor)
        self._next_epoch, self._resume_at, self._resume_cursor = epoch, done, cursor
        self._pending = True

    def epoch_length(self) -> int | None:
        """Batches in a whole epoch (however far the current one has got), or None if the
        loader has no length."""
        sampler = self.sampler
        if isinstance(sampler, ResumableSampler):
            return self._batches(sampler.num_samples)
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return None

    @property
    def seed(self) -> int | None:
        """The sampler's shuffling seed, when it has one."""
        return getattr(self.sampler, "seed", None)

    @property
    def sampler(self) -> Any:
        """The underlying loader's sampler (a ``DistributedSampler`` when sharded)."""
        return getattr(self.loader, "sampler", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """Everything else users read of a loader (``dataset``, ``batch_size``, ``drop_last``,
        ``num_workers``, ...) is the wrapped loader's."""
        if name == "loader":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self.epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        self.batch_in_epoch, self._resume_at = self._resume_at, 0
        self._base, self._resume_cursor = (self.batch_in_epoch, self._resume_cursor), 0
        self._pending = False
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.cursor = self._base[1]
            generator = getattr(self.loader, "generator", None)
            if generator is not None:  # worker seeds depend on (seeds, epoch) only
                generator.manual_seed((self._generator_seed + self.sampler.seed * 1_000_003
                                       + self.epoch) % 2**63)
        device, non_blocking = self.device, self.non_blocking
        # a loader on torch's global generator draws its base seed from it when an epoch's
        # iteration starts; the uninterrupted run drew it before the checkpoint it resumes
        # from was saved, so a resumed epoch must not draw it again (dropout would shift)
        resumed = self._base != (0, 0) and getattr(self.loader, "generator", 0) is None
        before = torch.get_rng_state() if resumed else None
        iterator = iter(self.loader)
        if before is not None:
            torch.set_rng_state(before)
        for batch in iterator:
            if self._move:
                batch = to_device(batch, device, non_blocking=non_blocking)
            self.batch_in_epoch += 1
            yield batch


def _unsplittable(loader: Iterable[Any]) -> str | None:
    """Why ``loader`` cannot be rebuilt around a DistributedSampler, or None if it can."""
    if not isinstance(loader, DataLoader):
        return (f"the loader is a {type(loader).__name__}, not a torch DataLoader, so shardwise "
                "cannot split it across ranks; pass a DataLoader, or split the data yourself "
                "and leave the loader out of the pipeline call")
    if isinstance(loader.dataset, IterableDataset):
        return (f"the loader's dataset is an IterableDataset ({type(loader.dataset).__name__}), "
                "which a sampler cannot split; yield only this rank's share in the dataset "
                "(torch.distributed.get_rank()) and leave the loader out of the pipeline call")
    if loader.batch_size is None:
        return ("the loader has batch_size=None (a batch_sampler, or no batching); shardwise "
                "needs batch_size and shuffle to build the distributed sampler")
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and (sampler.replacement
                                               or sampler._num_samples is not None):
        return ("the loader's RandomSampler draws with replacement or a set num_samples, which "
                "a DistributedSampler cannot reproduce; use shuffle=True alone, or shard the "
                "data yourself and pass a loader whose sampler is a DistributedSampler")
    if not isinstance(sampler, (RandomSampler, SequentialSampler)):
        return (f"the loader's sampler is a {type(sampler).__name__}; shardwise can distribute "
                "loaders built with shuffle=True/False. Use a DistributedSampler of your own "
                "(it is kept as is)")
    return None


def _check_own_sampler(loader: Any, copies: int, shares: int, share: int,
                       groups: bool = False) -> None:
    """A user's DistributedSampler beside tensor-parallel groups (or across replica
    ``groups``) must split over the data ranks (``shares``), this rank reading share
    ``share``."""
    sampler = loader.sampler
    if (copies > 1 or groups) and (sampler.num_replicas, sampler.rank) != (shares, share):
        where = (f"with tensor-parallel groups of {copies}" if copies > 1 else
                 "across fault_tolerant()'s replica groups")
        raise DataError(
            f"the loader's DistributedSampler splits the data over num_replicas="
            f"{sampler.num_replicas} (this rank: {sampler.rank}), but {where} the data ranks "
            f"are {shares} (this rank reads share {share}); build it with num_replicas="
            f"{shares}, rank={share}, or pass a loader built with shuffle=True/False")


def shard_loader(loader: Iterable[Any], env: Env, *, seed: int = 0,
                 pin_memory: bool = False, mesh: MeshLayout | None = None,
                 split: str = "samples", global_seed: bool = False,
                 replica: tuple[int, int] | None = None) -> Iterable[Any]:
    """A copy of ``loader`` whose sampler is a ``DistributedSampler`` for ``env``.

    Keeps batch_size, shuffle, drop_last, collate_fn, workers and the rest. The shuffling
    order comes from ``seed`` and the epoch (not from torch's global RNG), in one process
    too, so one process and N ranks read the same global batches. A loader that already has
    a ``DistributedSampler`` is kept; in one process, so is a loader that cannot be split.
    With a ``mesh`` (tensor parallel), the data is split over its data ranks only: the ranks
    of a tensor-parallel group read the same share. ``split``: ``"samples"`` (rank r reads
    samples r, r + n, ... of the order, as ``DistributedSampler``) or ``"batches"`` (whole
    batches r, r + n, ..., every rank's last batch full: Accelerate's split).
    ``global_seed``: without a generator of the user's, each epoch's iteration draws its
    worker seed from torch's global random stream, as a plain or Accelerate-prepared
    DataLoader does (later dropout and seeded inits then match theirs); by default the
    loader has its own generator and draws nothing from it (a resumed run then consumes
    random numbers exactly as an uninterrupted one). ``replica``: ``(group, groups)`` of
    ``fault_tolerant()``'s replica groups (see :func:`~shardwise.parallel.mesh.data_share`).

    Raises:
        DataError: several ranks and a loader that cannot be split across them, or a
            ``DistributedSampler`` of the user's that splits over other ranks than the data's.
    """
    shares, share, copies = data_share(env, mesh, replica)
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        _check_own_sampler(loader, copies, shares, share, replica is not None)
        return loader
    problem = _unsplittable(loader)
    if problem is not None:
        if shares > 1 or copies > 1:
            raise DataError(problem)
        return loader
    assert isinstance(loader, DataLoader)
    sampler = ResumableSampler(
        loader.dataset, num_replicas=shares, rank=share,
        shuffle=isinstance(loader.sampler, RandomSampler), seed=seed, drop_last=loader.drop_last,
        chunk=loader.batch_size if split == "batches" and loader.batch_size else 1)
    extra: dict[str, Any] = {}
    if loader.num_workers > 0:
        extra = dict(prefetch_factor=loader.prefetch_factor,
                     persistent_workers=loader.persistent_workers)
    if hasattr(loader, "in_order"):
        extra["in_order"] = loader.in_order
    if getattr(loader, "pin_memory_device", ""):
        extra["pin_memory_device"] = loader.pin_memory_device
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler,
        num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=pin_memory or loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        # the loader's own generator (seeded per epoch by DeviceLoader) rather than torch's
        # global one: starting an epoch then draws nothing from the RNG the model uses, so a
        # resumed run consumes random numbers exactly as an uninterrupted one
        generator=loader.generator if loader.generator is not None or global_seed
        else torch.Generator(),
        **extra)


def _fingerprint(batch: Any, device: torch.device) -> torch.Tensor:
    """Four numbers that differ between batches: tensors, elements, sum, position-weighted sum."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    values = [t.detach().to(device, torch.float64).flatten() for t in leaves]
    flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64, device=device)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
    return torch.stack([torch.tensor(float(len(leaves)), dtype=torch.float64, device=device),
                        torch.tensor(float(flat.numel()), dtype=torch.float64, device=device),
                        flat.sum(), (flat * weights).sum()])


def same_batch(batch: Any, copies: int, device: torch.device) -> None:
    """Check that the ``copies`` consecutive ranks of each pipeline-, tensor- or
    context-parallel group (a ``pp x cp x tp`` block of the mesh) were given the
    same batch (one all-gather and one host read; the step does it on its first call).

    Raises:
        DataError: naming the ranks whose batches differ.
    """
    mine = _fingerprint(batch, device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    prints = torch.stack(every).tolist()
    for start in range(0, len(prints), copies):
        group = prints[start:start + copies]
        if any(p != group[0] for p in group[1:]):
            raise DataError(
                f"ranks {start}..{start + copies - 1} form one pipeline-/tensor-/context-parallel "
                "group and must "
                "be given the same batch, but their first batches differ; iterate "
                "bundle.loader (split over the data ranks only), or give every rank of a "
                f"group the batch of data rank rank // {copies}")
