# local_sgd in one process (refused where it cannot run, else a no-op) and Ulysses' sequence slices.
import pytest
import torch

import shardwise as sw
from shardwise.errors import ConflictError
from shardwise.parallel.ulysses import sequence_slice
from shardwise.testing import TinyMLP

from _local_sgd import EVERY, batches, snapshot


def test_local_sgd_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="every"):
        sw.local_sgd(every=0)
    with pytest.raises(ConflictError, match=r"local_sgd\(every=2, outer=None\) needs replicate\(\) or "
                                           r"fault_tolerant\(\)"):
        sw.pipeline(sw.Env(), sw.shard(), sw.local_sgd(every=2))
    with pytest.raises(ConflictError, match="ZeRO-1 broadcasts"):
        sw.pipeline(sw.Env(), sw.replicate(), sw.shard_optimizer(), sw.local_sgd(every=2))


def test_in_one_process_local_sgd_changes_nothing():
    def run(*extra):
        torch.manual_seed(0)
        model = TinyMLP()
        bundle = sw.pipeline(sw.Env(), sw.replicate(), *extra)(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = bundle.init()
        for batch in batches(0):
            state, _ = bundle.step(state, batch)
        return snapshot(model)

    plain, local = run(), run(sw.local_sgd(every=EVERY))
    assert all(torch.equal(plain[k], local[k]) for k in plain)


def test_slices_and_heads_that_do_not_divide_are_refused_by_number():
    with pytest.raises(ConflictError, match="length divides by 4; got length 6"):
        sequence_slice(torch.zeros(1, 6), 0, 4)
    assert sequence_slice(torch.arange(8).reshape(1, 8), 1, 2).tolist() == [[4, 5, 6, 7]]
