# sw.local_sgd: each replica steps alone, parameters averaged every k steps, as Accelerate's LocalSGD.
# Its tests that start no process are in tests/unit/test_local_sgd_and_ulysses.py.
import torch

import shardwise as sw
from shardwise.testing import TinyMLP, run_distributed

from _local_sgd import EVERY, batches, snapshot


def on_accelerate():
    """Accelerate's LocalSGD example loop on this rank's batches: the parameters after step
    2 (between averages) and after the run."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyMLP()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=EVERY,
                  enabled=True) as local:
        for x, y in batches(accelerator.process_index):
            accelerator.backward(model(x, y))
            optimizer.step()
            optimizer.zero_grad()
            local.step()
            seen.append(snapshot(accelerator.unwrap_model(model)))
    return seen[1], snapshot(accelerator.unwrap_model(model))


def on_shardwise():
    env = sw.detect()
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = sw.pipeline(env, sw.replicate(), sw.local_sgd(every=EVERY))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = bundle.init()
    seen = []
    for batch in batches(env.rank):
        state, out = bundle.step(state, batch)
        assert out.stepped
        seen.append(snapshot(bundle.engine.unwrap(bundle.model)))
    return seen[1], seen[-1]


def test_local_sgd_equals_accelerates_local_sgd_on_the_same_samples():
    """Between averages each rank's parameters are its own (no gradient all-reduce), the same
    as under Accelerate's LocalSGD on that rank; after every 3rd step they are averaged."""
    theirs = run_distributed(on_accelerate, world_size=2, timeout=180)
    ours = run_distributed(on_shardwise, world_size=2, timeout=180)
    for rank in (0, 1):
        for name, value in theirs[rank][0].items():
            torch.testing.assert_close(ours[rank][0][name], value, rtol=0, atol=1e-7)
            torch.testing.assert_close(ours[rank][1][name], theirs[rank][1][name], rtol=0,
                                       atol=1e-7)
    # between averages the replicas differ; after the 6th step they are one model
    assert any(not torch.equal(ours[0][0][k], ours[1][0][k]) for k in ours[0][0])
    assert all(torch.equal(ours[0][1][k], ours[1][1][k]) for k in ours[0][1])


def resumable(root, save_at, halt):
    """Train to step STEPS (resuming from ``root`` when it holds a checkpoint), saving at
    step ``save_at`` and, with ``halt``, stopping there. Each rank's parameters at the end."""
    env = sw.detect()
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = sw.pipeline(env, sw.replicate(), sw.local_sgd(every=EVERY))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = sw.load(root, bundle) if sw.latest_checkpoint(root) else bundle.init()
    for batch in batches(env.rank)[state.step:]:
        state, _ = bundle.step(state, batch)
        if state.step == save_at:
            sw.save(root, bundle, state)
            if halt:
                return None
    return snapshot(bundle.engine.unwrap(bundle.model))


def test_a_save_is_a_synchronisation_point_and_a_resumed_run_equals_the_uninterrupted_one(
        tmp_path):
    """Saving at step 4 (between averages) averages parameters and optimizer state, so the
    checkpoint is the one state every rank resumes from: stopped there and resumed in new
    processes, the run ends as the one that saved at step 4 and went on."""
    whole = run_distributed(resumable, str(tmp_path / "whole"), 4, False, world_size=2,
                            timeout=180)
    run_distributed(resumable, str(tmp_path / "cut"), 4, True, world_size=2, timeout=180)
    resumed = run_distributed(resumable, str(tmp_path / "cut"), None, False, world_size=2,
                              timeout=180)
    for rank in (0, 1):
        for name, value in whole[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)
    assert all(torch.equal(whole[0][k], whole[1][k]) for k in whole[0])


class Pairs(torch.utils.data.Dataset):
    """20 (x, y) samples: 5 batches of 2 per rank an epoch on 2 ranks."""

    def __init__(self):
        generator = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(20, 8, generator=generator), torch.randn(20, 1, generator=generator)

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def epochs_on_accelerate():
    """Accelerate's LocalSGD as its docs use it: a context per epoch, which averages the
    parameters when it exits (no average within: 100 steps between)."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyMLP()
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.utils.data.DataLoader(Pairs(), batch_size=2))
    ends = []
    for _ in range(2):
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=100,
                      enabled=True) as local:
            for x, y in loader:
                accelerator.backward(model(x, y))
                optimizer.step()
                optimizer.zero_grad()
                local.step()
        ends.append(snapshot(accelerator.unwrap_model(model)))
    return ends


def epochs_on_shardwise():
    """The same over bundle.loader: each epoch's end averages; then sw.average_replicas
    averages between two ends, on demand."""
    env = sw.detect()
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = sw.pipeline(env, sw.replicate(), sw.local_sgd(every=100),
                         sw.distribute_data(split="batches"))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.utils.data.DataLoader(Pairs(), batch_size=2))
    state, ends = bundle.init(), []
    for _ in range(2):
        for batch in bundle.loader:
            state, _ = bundle.step(state, batch)
        ends.append(snapshot(bundle.engine.unwrap(bundle.model)))
    for batch in list(bundle.loader)[:2]:  # two steps more: the replicas drift apart
        state, _ = bundle.step(state, batch)
    drifted = snapshot(bundle.engine.unwrap(bundle.model))
    probe = (torch.ones(3, 8), torch.zeros(3, 1))
    before = bundle.predict(probe)
    sw.average_replicas(bundle)
    return ends, drifted, snapshot(bundle.engine.unwrap(bundle.model)), before, \
        bundle.predict(probe)


def test_each_epoch_end_averages_as_accelerates_local_sgd_context_and_on_demand():
    theirs = run_distributed(epochs_on_accelerate, world_size=2, timeout=180)
    ours = run_distributed(epochs_on_shardwise, world_size=2, timeout=180)
    for rank in (0, 1):
        for epoch in (0, 1):
            for name, value in theirs[rank][epoch].items():
                torch.testing.assert_close(ours[rank][0][epoch][name], value, rtol=0, atol=1e-7)
    ends = [ours[0][0][1], ours[1][0][1]]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])  # one model at epoch end
    drifted, averaged = [r[1] for r in ours], [r[2] for r in ours]
    assert any(not torch.equal(drifted[0][k], drifted[1][k]) for k in drifted[0])
    assert all(torch.equal(averaged[0][k], averaged[1][k]) for k in averaged[0])
    assert not torch.equal(ours[0][3], ours[1][3])  # two models predicted differently
    assert torch.equal(ours[0][4], ours[1][4])  # after average_replicas: one


def one_rank_not_finite():
    """every=1 with SGD with momentum (no fused kernel: the check is read at once): rank 0's
    first step is not finite (it raises), rank 1's is; both go on. The replicas still average
    at each step, in step (the raising rank joined the first average)."""
    env = sw.detect()
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = sw.pipeline(env, sw.replicate(), sw.local_sgd(every=1))(
        model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    state, raised = bundle.init(), False
    x, y = batches(env.rank, 2)[0]
    try:
        state, _ = bundle.step(state, (x * (float("nan") if env.rank == 0 else 1.0), y))
    except sw.errors.NonFiniteError as exc:
        state, raised = exc.state, True
    state, _ = bundle.step(state, batches(env.rank, 2)[1])
    return raised, snapshot(bundle.engine.unwrap(bundle.model))


def test_a_replica_whose_step_is_not_finite_still_joins_the_average():
    runs = run_distributed(one_rank_not_finite, world_size=2, timeout=90)
    assert [raised for raised, _ in runs] == [True, False]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
