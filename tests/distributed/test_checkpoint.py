# save / load: exact round trips and resumes on real gloo ranks, resharding, atomicity, errors.
# Its tests that start no process are in tests/unit/test_save_load.py.
import json
import os

import pytest
import torch

import shardwise as sw
from shardwise.errors import RankFailedError
from shardwise.testing import TinyMLP, full_state, run_distributed

from _checkpointing import _optimizer_tensors
from conftest import build_lm as build
from conftest import train_for

LAYOUTS = {"replicate": [sw.replicate()], "shard": [sw.shard()],
           "zero1": [sw.replicate(), sw.shard_optimizer()]}


def straight(root):
    out = {}
    for name, parts in LAYOUTS.items():
        bundle = build(parts)
        torch.manual_seed(1234)
        state, losses = train_for(bundle, bundle.init(), 20)
        out[name] = {"losses": losses, "params": full_state(bundle.model), "state": state}
    return out


def first_half(root):
    out = {}
    for name, parts in LAYOUTS.items():
        bundle = build(parts)
        torch.manual_seed(1234)
        state, losses = train_for(bundle, bundle.init(), 10)
        path = sw.save(os.path.join(root, name), bundle, state)
        out[name] = {"losses": losses, "path": str(path)}
    return out


def second_half(root):
    out = {}
    for name, parts in LAYOUTS.items():
        bundle = build(parts)
        torch.manual_seed(999)  # must not matter: the checkpoint restores the generators
        state = sw.load(os.path.join(root, name), bundle)
        state, losses = train_for(bundle, state, 10)
        out[name] = {"losses": losses, "params": full_state(bundle.model), "state": state}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    whole = run_distributed(straight, root, world_size=2, timeout=300)
    first = run_distributed(first_half, root, world_size=2, timeout=300)
    second = run_distributed(second_half, root, world_size=2, timeout=300)
    return root, whole, first, second


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_in_new_processes_is_bit_exact(resumed, layout):
    _, whole, first, second = resumed
    for rank in range(2):
        expected = whole[rank][layout]
        assert first[rank][layout]["losses"] + second[rank][layout]["losses"] == expected["losses"]
        got = second[rank][layout]["params"]
        assert all(torch.equal(got[k], expected["params"][k]) for k in got)
        assert second[rank][layout]["state"] == expected["state"]
    assert expected["state"].epoch == 3  # the run crossed epoch ends (6 batches an epoch)


def test_checkpoint_layout_on_disk(resumed):
    root, _, first, _ = resumed
    path = first[0]["shard"]["path"]
    assert os.path.basename(path) == "step_00000005"
    names = set(os.listdir(path))
    assert {"shardwise.json", ".metadata", "rng"} <= names
    assert sorted(os.listdir(os.path.join(path, "rng"))) == ["rank_00000.json", "rank_00001.json"]
    meta = json.loads(open(os.path.join(path, "shardwise.json")).read())
    assert meta["train_state"]["step"] == 5 and meta["world_size"] == 2
    # 4 batches of 4 on each of 2 ranks: 32 samples of the epoch's order read, of 48
    assert meta["data"] == {"epoch": 1, "batch_in_epoch": 4, "seed": 0, "cursor": 32,
                            "samples": 48, "shuffle": True}
    assert open(os.path.join(root, "shard", "latest")).read().strip() == "step_00000005"


def load_and_report(path, parts):
    bundle = build(parts)
    state = sw.load(path, bundle)
    params = full_state(bundle.model)
    state, losses = train_for(bundle, state, 4)
    return {"params": params, "state": state, "losses": losses}


def test_two_rank_checkpoints_load_in_one_process_and_across_layouts(resumed):
    root, _, first, _ = resumed
    saved = run_distributed(load_and_report, os.path.join(root, "shard"), [sw.shard()],
                            world_size=2)[0]["params"]
    one = load_and_report(os.path.join(root, "shard"), [])  # 2 -> 1, shard -> one process
    assert all(torch.equal(one["params"][k], saved[k]) for k in saved)
    assert one["state"].step == 7 and all(torch.isfinite(torch.tensor(one["losses"])))
    across = run_distributed(load_and_report, os.path.join(root, "shard"), [sw.replicate()],
                             world_size=2)[0]  # shard -> replicate
    assert all(torch.equal(across["params"][k], saved[k]) for k in saved)
    zero = load_and_report(os.path.join(root, "zero1"), [])  # ZeRO-1 on 2 ranks -> 1 process
    assert zero["state"].step == 7 and all(torch.isfinite(torch.tensor(zero["losses"])))


def save_one_process(root):
    bundle = build([])
    state, _ = train_for(bundle, bundle.init(), 6)
    sw.save(root, bundle, state)
    return full_state(bundle.model)


def test_one_process_checkpoint_loads_sharded_on_two_ranks(tmp_path):
    saved = save_one_process(str(tmp_path))
    loaded = run_distributed(load_and_report, str(tmp_path), [sw.shard()], world_size=2)
    for rank in loaded:
        assert all(torch.equal(rank["params"][k], saved[k]) for k in saved)
        assert rank["state"].step == 5


def save_twice_and_die_in_the_second(root):
    bundle = build([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    sw.save(root, bundle, state)
    state, _ = train_for(bundle, state, 1)
    if sw.detect().rank == 1:
        import shardwise.checkpoint.rng

        def die():
            os._exit(3)  # killed in the middle of writing

        shardwise.checkpoint.rng.capture = die
    sw.save(root, bundle, state)


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankFailedError):
        run_distributed(save_twice_and_die_in_the_second, str(tmp_path), world_size=2, timeout=120)
    assert sw.latest_checkpoint(tmp_path).name == "step_00000001"
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    bundle = build([], accumulate=1)
    assert sw.load(tmp_path, bundle).step == 1  # 2 -> 1 and still loadable


def round_trip_in_place(root):
    """On 2 ranks: save, train on, load in the same processes; everything comes back."""
    out = {}
    for name, parts in LAYOUTS.items():
        bundle = build(parts)
        state, _ = train_for(bundle, bundle.init(), 6)
        engine = bundle.sharded_optimizer or bundle.optimizer
        before = (full_state(bundle.model), _optimizer_tensors(engine), torch.get_rng_state(),
                  bundle.scheduler.state_dict())
        sw.save(os.path.join(root, name), bundle, state)
        train_for(bundle, state, 4)
        loaded = sw.load(os.path.join(root, name), bundle)
        after = (full_state(bundle.model), _optimizer_tensors(engine), torch.get_rng_state(),
                 bundle.scheduler.state_dict())
        out[name] = {
            "state": loaded == state,
            "params": all(torch.equal(after[0][k], v) for k, v in before[0].items()),
            "optimizer": before[1].keys() == after[1].keys()
            and all(torch.equal(after[1][k], v) for k, v in before[1].items()),
            "rng": torch.equal(before[2], after[2]), "scheduler": before[3] == after[3]}
    return out


def test_round_trip_on_two_ranks_in_the_same_processes(tmp_path):
    for rank in run_distributed(round_trip_in_place, str(tmp_path), world_size=2, timeout=300):
        for name, checks in rank.items():
            assert all(checks.values()), (name, checks)


def frozen_zero(root):
    torch.manual_seed(0)
    model = TinyMLP()
    model.fc1.weight.requires_grad_(False)
    bundle = sw.pipeline(sw.detect(), sw.replicate(), sw.shard_optimizer())(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state, _ = bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    sw.save(root, bundle, state)
    kernels = (bundle.optimizer.param_groups[0]["fused"],
               bundle.sharded_optimizer.optim.param_groups[0]["fused"])
    return full_state(bundle.model), kernels


def test_zero1_with_frozen_parameters_loads_in_one_process(tmp_path):
    saved, kernels = run_distributed(frozen_zero, str(tmp_path), world_size=2)[0]
    assert kernels == (None, None)  # ZeRO-1 keeps the user's implementation
    model = TinyMLP()
    model.fc1.weight.requires_grad_(False)
    one = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert sw.load(tmp_path, one).step == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    # written by the default implementation, loaded into the fused one: it stays fused
    assert one.optimizer.param_groups[0]["fused"] is True
    one.step(sw.TrainState(step=1), (torch.randn(4, 8), torch.randn(4, 1)))


def epochs_loop(bundle, state, epochs, stop_at=None):
    """The loop the docs give, for a fresh and a resumed run alike; ``stop_at`` micro-steps
    interrupts it (a job ended there)."""
    for _ in range(state.epoch, epochs):
        for batch in bundle.loader:
            state, _ = bundle.step(state, batch)
            if state.micro_step == stop_at:
                return state
    return state


# 6 batches an epoch on 2 ranks, windows of 2, 3 epochs: 18 micro-steps
SAVE_POINTS = {"mid-epoch": 10, "end of epoch": 12, "end of training": 18}


def resume_from_each_save_point(root):
    out = {}
    for name, parts in {"replicate": [sw.replicate()], "shard": [sw.shard()]}.items():
        bundle = build(parts)
        torch.manual_seed(1234)
        whole = epochs_loop(bundle, bundle.init(), 3)
        out[name, "whole"] = (whole, full_state(bundle.model))
        for point, stop in SAVE_POINTS.items():
            path = os.path.join(root, name, point.replace(" ", "_"))
            bundle = build(parts)
            torch.manual_seed(1234)
            sw.save(path, bundle, epochs_loop(bundle, bundle.init(), 3, stop_at=stop))
            again = build(parts)
            state = sw.load(path, again)
            agree = (state.epoch, state.batch_in_epoch) == (again.loader._next_epoch,
                                                              again.loader._resume_at)
            final = epochs_loop(again, state, 3)
            out[name, point] = (final, full_state(again.model), agree)
    return out


def test_the_documented_loop_resumes_from_every_save_point_as_if_uninterrupted(tmp_path):
    for rank_result in run_distributed(resume_from_each_save_point, str(tmp_path), timeout=300):
        for name in ("replicate", "shard"):
            whole, params = rank_result[name, "whole"]
            assert (whole.step, whole.micro_step, whole.epoch) == (9, 18, 3)
            for point in SAVE_POINTS:
                final, got, agree = rank_result[name, point]
                assert agree, (name, point)  # state and loader say the same position
                assert final == whole, (name, point, final)  # no extra epoch, no lost batch
                assert all(torch.equal(got[k], params[k]) for k in params), (name, point)
