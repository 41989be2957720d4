# distribute_data in one process: structure-preserving transfer, loader settings, refusals.
import collections

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    WeightedRandomSampler,
)

import shardwise as sw
from shardwise.data import DeviceLoader, shard_loader
from shardwise.errors import DataError
from shardwise.testing import SyntheticRegression

TWO = sw.Env(world_size=2, rank=1, local_world_size=2)
Pair = collections.namedtuple("Pair", "a b")


def test_to_device_moves_every_tensor_and_keeps_the_structure():
    batch = {"x": torch.ones(2), "nested": {"t": (torch.zeros(1), 3, "s")},
             "pair": Pair(torch.ones(1), [torch.ones(3)])}
    moved = sw.to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta"
    assert moved["nested"]["t"][0].device.type == "meta" and moved["nested"]["t"][1:] == (3, "s")
    assert isinstance(moved["pair"], Pair) and moved["pair"].b[0].device.type == "meta"
    assert batch["x"].device.type == "cpu"


def test_device_loader_on_cpu_hands_batches_through_untouched():
    batches = [(torch.ones(2), torch.zeros(2))]
    loader = DeviceLoader(batches, torch.device("cpu"))
    assert next(iter(loader))[0] is batches[0][0]


def test_device_loader_moves_batches_when_the_device_is_not_the_cpu():
    loader = DeviceLoader([{"x": torch.ones(2)}], torch.device("meta"))
    assert next(iter(loader))["x"].device.type == "meta"


def test_shard_loader_keeps_the_users_settings():
    def collate(items):
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    loader = DataLoader(SyntheticRegression(size=10), batch_size=3, shuffle=True, drop_last=True,
                        collate_fn=collate)
    sharded = shard_loader(loader, TWO, seed=7)
    assert isinstance(sharded, DataLoader)
    sampler = sharded.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (2, 1, True, 7)
    assert (sharded.batch_size, sharded.drop_last, sharded.collate_fn) == (3, True, collate)
    assert len(sharded) == 1  # 5 samples on this rank, batches of 3, last dropped
    sequential = shard_loader(DataLoader(SyntheticRegression(size=10), batch_size=2), TWO)
    assert sequential.sampler.shuffle is False


def test_a_loader_with_its_own_distributed_sampler_is_kept():
    data = SyntheticRegression(size=8)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1))
    assert shard_loader(loader, TWO) is loader


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.ones(1)


@pytest.mark.parametrize("loader, message", [
    ([1, 2], "is a list, not a torch DataLoader"),
    (DataLoader(Stream()), "IterableDataset (Stream)"),
    (DataLoader(SyntheticRegression(size=4), sampler=WeightedRandomSampler([1.0] * 4, 4)),
     "sampler is a WeightedRandomSampler"),
    (DataLoader(SyntheticRegression(size=4),
                sampler=RandomSampler(range(4), replacement=True)), "draws with replacement"),
])
def test_loaders_that_cannot_be_split_are_refused(loader, message):
    with pytest.raises(DataError) as info:
        shard_loader(loader, TWO)
    assert message in str(info.value)


def test_one_process_keeps_loaders_that_cannot_be_split():
    one = sw.Env()
    weighted = DataLoader(SyntheticRegression(size=4), sampler=WeightedRandomSampler([1.0] * 4, 4))
    for loader in ([1, 2], DataLoader(Stream()), weighted,
                   DataLoader(SyntheticRegression(size=4), batch_size=None)):
        assert shard_loader(loader, one) is loader


def test_shard_loader_copies_worker_and_memory_settings():
    def init(worker_id):
        return None

    gen = torch.Generator().manual_seed(3)
    loader = DataLoader(SyntheticRegression(size=8), batch_size=2, shuffle=True, num_workers=2,
                        persistent_workers=True, prefetch_factor=3, timeout=5.0,
                        worker_init_fn=init, generator=gen, in_order=False)
    copy = shard_loader(loader, TWO)
    assert (copy.num_workers, copy.persistent_workers, copy.prefetch_factor) == (2, True, 3)
    assert (copy.timeout, copy.worker_init_fn, copy.generator) == (5.0, init, gen)
    assert copy.in_order is False and copy.pin_memory is False
    assert shard_loader(loader, TWO, pin_memory=True).pin_memory is True


def test_pin_memory_without_cuda_is_refused():
    with pytest.raises(DataError, match="pinned memory needs a CUDA device"):
        sw.pipeline(sw.Env(), sw.distribute_data(pin_memory=True))(
            torch.nn.Linear(1, 1), None, DataLoader(SyntheticRegression(size=4)))


def test_the_device_loader_reads_like_the_loader_it_wraps():
    data = SyntheticRegression(size=10)
    bundle = sw.Bundle(torch.nn.Linear(8, 1), loader=DataLoader(data, batch_size=3, drop_last=True),
                       env=TWO)
    loader = sw.distribute_data()(bundle).loader
    assert isinstance(loader, DeviceLoader)
    assert loader.dataset is data and loader.batch_size == 3 and loader.drop_last
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.rank == 1
    assert len(loader) == 1  # this rank's 5 samples make one whole batch of 3
    with pytest.raises(AttributeError):
        loader.no_such_attribute  # noqa: B018


@pytest.mark.parametrize("samples", [16, 13, 5, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_batches_split_deals_each_rank_the_batches_accelerate_deals_it(samples, shuffle,
                                                                         drop_last):
    """``split="batches"`` against Accelerate's own BatchSamplerShard over its seeded sampler:
    the same indices on every rank, in the same batches, the last partial round included."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    from shardwise.data import ResumableSampler

    world, size, seed = 2, 2, 7
    data = list(range(samples))
    order = accelerate.SeedableRandomSampler(data, data_seed=seed) if shuffle else \
        torch.utils.data.SequentialSampler(data)
    for epoch in (0, 1):
        for rank in range(world):
            if shuffle:  # its iteration moves it to the next epoch: set it for each rank
                order.set_epoch(epoch)
            theirs = [i for batch in accelerate.BatchSamplerShard(
                torch.utils.data.BatchSampler(order, size, drop_last), num_processes=world,
                process_index=rank) for i in batch]
            sampler = ResumableSampler(data, num_replicas=world, rank=rank, shuffle=shuffle,
                                       seed=seed, drop_last=drop_last, chunk=size)
            sampler.set_epoch(epoch)
            assert list(sampler) == theirs, (rank, epoch)
            assert len(sampler) == len(theirs)


def test_the_batches_split_resumes_mid_epoch_without_rereading_a_sample():
    from shardwise.data import ResumableSampler

    def ranks(cursor=0, world=2):
        out = []
        for rank in range(world):
            sampler = ResumableSampler(list(range(20)), num_replicas=world, rank=rank,
                                       shuffle=True, seed=3, chunk=2)
            sampler.cursor = cursor
            out.append(list(sampler))
        return out

    whole = ranks()
    # two global batches of 2 x 2 read: the rest of each rank's stream, exactly
    assert ranks(cursor=8) == [whole[0][4:], whole[1][4:]]
    # at another world size every remaining sample is read once; the 4 that make whole
    # rounds of 4 ranks x 2 repeat the epoch's first (already read) samples, as
    # DistributedSampler pads
    read = {i for share in whole for i in share[:4]}
    rest = collections.Counter(i for share in ranks(cursor=8, world=4) for i in share)
    assert {i: rest[i] for i in set(range(20)) - read} == dict.fromkeys(set(range(20)) - read, 1)
    assert sum(rest.values()) == 16 and set(rest) - (set(range(20)) - read) <= read


@pytest.mark.parametrize("global_seed", [False, True])
def test_a_loader_draws_from_the_global_stream_only_when_asked(global_seed):
    """By default a sharded loader has its own generator (a resumed run draws what an
    uninterrupted one draws); ``global_seed=True`` draws one number per epoch from torch's
    global stream, as a plain or Accelerate-prepared DataLoader does."""
    loader = DataLoader(SyntheticRegression(8), batch_size=2, shuffle=True)
    sharded = shard_loader(loader, sw.Env(), seed=1, global_seed=global_seed)
    torch.manual_seed(0)
    list(sharded)
    after = torch.rand(1)
    torch.manual_seed(0)
    untouched = torch.rand(1)
    assert torch.equal(after, untouched) is not global_seed


def test_the_epoch_order_is_accelerates_seedable_sampler_with_the_same_seed():
    """docs/migrating-from-accelerate.md: distribute_data(seed=S) reads each epoch in the
    order of Accelerate's SeedableRandomSampler(data_seed=S) (use_seedable_sampler=True)."""
    pytest.importorskip("accelerate")
    from accelerate.data_loader import SeedableRandomSampler

    data = torch.arange(20)
    loader = sw.pipeline(sw.Env(), sw.distribute_data(seed=7))(
        torch.nn.Linear(1, 1), None, torch.utils.data.DataLoader(data, batch_size=1, shuffle=True)
    ).loader
    for epoch in range(3):
        ours = [int(batch) for batch in loader]
        theirs = SeedableRandomSampler(data_source=data, data_seed=7)
        theirs.set_epoch(epoch)
        assert ours == list(theirs), epoch


def test_leaving_an_epoch_early_starts_the_next_and_set_epoch_repeats_one():
    """docs/migrating-from-accelerate.md: after a break the next loop is the next epoch's
    order (Accelerate's loader would replay the same epoch); set_epoch(e) repeats epoch e."""
    data = torch.arange(12)
    loader = sw.pipeline(sw.Env(), sw.distribute_data(seed=3))(
        torch.nn.Linear(1, 1), None, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    ).loader
    first = [batch.tolist() for batch in loader]
    for batch in loader:  # epoch 1, left after one batch
        left = batch.tolist()
        break
    assert loader.epoch == 1 and left != first[0]
    assert [batch.tolist() for batch in loader] != first  # epoch 2: another order
    loader.set_epoch(0)
    assert [batch.tolist() for batch in loader] == first
