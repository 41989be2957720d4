# sw.load in one process: all or nothing, a clean window, the data position without re-reading a sample.
import copy

import pytest
import torch
from torch.utils.data import DistributedSampler

import shardwise as sw
from shardwise.errors import ArgumentError, CheckpointError

from _checkpointing import ids_bundle
from conftest import build_lm, fingerprint, lm_bundle, same, train_for

# -- all or nothing ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved part-way through epoch 0 (3 of 12 batches), AdamW + StepLR."""
    root = tmp_path_factory.mktemp("ckpt")
    bundle = lm_bundle()
    state, _ = train_for(bundle, bundle.init(), 3)
    return sw.save(root, bundle, state)


MISMATCHES = {
    "optimizer class": (dict(optimizer="adam"),
                        r"optimizer: checkpoint torch.optim.adamw.AdamW, bundle "
                        r"torch.optim.adam.Adam.*skip=\('optimizer',\)"),
    "parameter groups": (dict(groups=2), r"parameter groups \(parameters in each\): checkpoint "
                                         r"\[\d+\], bundle \[3, \d+\]"),
    "scheduler class": (dict(scheduler="cosine"),
                        r"scheduler: checkpoint torch.optim.lr_scheduler.StepLR, bundle "
                        r"torch.optim.lr_scheduler.CosineAnnealingLR.*skip=\('scheduler',\)"),
    "scheduler missing": (dict(scheduler=None), r"scheduler: checkpoint "
                                                r"torch.optim.lr_scheduler.StepLR, bundle none"),
    "sampler seed": (dict(seed=7), r"sampler seed 0, this loader uses 7"),
    "dataset": (dict(size=64), r"48-sample dataset, this loader's dataset has 64 samples"),
    "user's sampler": (dict(sampler=lambda data: DistributedSampler(data, num_replicas=1, rank=0)),
                       r"sampler is a DistributedSampler, which cannot start part-way"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_refused_load_changes_nothing_and_names_both_sides(saved, case):
    kwargs, message = MISMATCHES[case]
    bundle = lm_bundle(**kwargs)
    state, _ = train_for(bundle, bundle.init(), 2)  # optimizer state and a loader position
    before = fingerprint(bundle)
    with pytest.raises(CheckpointError, match=message):
        sw.load(saved, bundle)
    assert same(before, fingerprint(bundle))


def test_a_scheduler_only_in_the_bundle_is_refused(tmp_path):
    bundle = lm_bundle(scheduler=None)
    state, _ = train_for(bundle, bundle.init(), 2)
    sw.save(tmp_path, bundle, state)
    other = lm_bundle()
    before = fingerprint(other)
    with pytest.raises(CheckpointError, match=r"scheduler: checkpoint none, bundle "
                                              r"torch.optim.lr_scheduler.StepLR"):
        sw.load(tmp_path, other)
    assert same(before, fingerprint(other))


def test_skip_loads_the_rest_of_a_checkpoint_into_changed_parts(saved):
    bundle = lm_bundle(optimizer="adam", scheduler="cosine")
    with pytest.raises(CheckpointError):
        sw.load(saved, bundle)
    scheduler_before = copy.deepcopy(bundle.scheduler.state_dict())
    state = sw.load(saved, bundle, skip=("optimizer", "scheduler"))
    assert state.step == 3 and not bundle.optimizer.state  # the Adam keeps its own (none)
    assert bundle.scheduler.state_dict() == scheduler_before
    reference = lm_bundle()
    sw.load(saved, reference)
    assert same(fingerprint(bundle)["model"], fingerprint(reference)["model"])
    with pytest.raises(ArgumentError, match="'skip' names 'model'; accepted: optimizer, "
                                            "scheduler, scaler, rng"):
        sw.load(saved, bundle, skip=("model",))
    with pytest.raises(ArgumentError, match="'skip' must be a tuple of part names"):
        sw.load(saved, bundle, skip="optimizer")


def test_a_load_in_the_middle_of_a_window_equals_a_clean_resume(tmp_path):
    bundle = build_lm([], accumulate=2)
    state, _ = train_for(bundle, bundle.init(), 4)
    path = sw.save(tmp_path, bundle, state)

    def resumed(micro_steps_before):
        again = build_lm([], accumulate=2)
        torch.manual_seed(11)
        if micro_steps_before:  # one micro-batch of a window: gradients accumulated
            train_for(again, again.init(), micro_steps_before)
            assert any(p.grad is not None for p in again.model.parameters())
        state = sw.load(path, again)
        state, _ = train_for(again, state, 4)
        return {k: v.clone() for k, v in again.model.state_dict().items()}

    clean, cut_short = resumed(0), resumed(1)
    assert same(clean, cut_short)


# -- the data position: a global cursor, any world size ------------------------------------

def test_positioning_reads_no_sample_before_the_cursor():
    bundle = ids_bundle(1000, size=1_000_000)
    bundle.loader.resume(0, 450, cursor=900_000)
    dataset = bundle.loader.dataset
    first = next(iter(bundle.loader))
    assert dataset.fetched == 1000 and first[0].shape == (1000, 8)
    assert len(bundle.loader.sampler) == 100_000
