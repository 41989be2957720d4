# sw.save(blocking=False): training goes on while files are written; published only when every rank is done.
# Its tests that start no process are in tests/unit/test_background_save.py.
"""A checkpoint written in the background holds the state of the moment it was asked for
(staged to host memory), loads and resumes exactly like a blocking one, is published only
after every rank's files are written, and a failure publishes nothing."""

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.testing import process_context, run_distributed

from _background_save import resume, train
from _checkpointing import equal
from conftest import build_lm


@pytest.mark.parametrize("parts", [[sw.replicate()], [sw.shard()]], ids=["replicate", "shard"])
def test_two_ranks_async_checkpoint_holds_the_asked_state_and_resumes_exactly(tmp_path, parts):
    path = str(tmp_path / "ckpt")
    ran = run_distributed(train, path, parts, False, world_size=2, timeout=300)
    assert ran[0]["published"] == ["step_00000002", "step_00000004"]
    # the second save waited for the first: at most one in flight
    assert all(r["first_done"] for r in ran)
    assert "published" in ran[0]["handle"]
    assert sorted(p.name for p in Path(path).iterdir()) == [".shardwise.lock", "latest", "step_00000004"]
    resumed = run_distributed(resume, path, parts, world_size=2, timeout=300)
    for rank, again in zip(ran, resumed, strict=True):
        assert again["step_loaded"] == "step_00000004"
        # training went on while the files were written: they hold step 4's weights
        assert equal(again["loaded"], rank["asked"][4])
        assert not equal(rank["asked"][4], rank["end"])
        assert equal(again["end"], rank["end"])


def fit_async(path):
    bundle = build_lm([sw.replicate()])
    state = sw.fit(bundle, steps=4, checkpoint_dir=path, checkpoint_every=2,
                   async_checkpoints=True, progress=False, log_every=None)
    return state.step, sw.latest_checkpoint(path).name


def test_fit_with_async_checkpoints_waits_at_the_end(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_distributed(fit_async, path, world_size=2, timeout=300) == [(4, "step_00000004")] * 2


# -- a process killed while a save is in flight leaves the previous checkpoint intact ---------

def saving_forever(path, ready):
    """Trains and saves in the background, step after step, until killed."""
    from shardwise.testing import TinyTransformerLM

    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=192, heads=4, layers=4)   # ~2 MB of state per save
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = bundle.init()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ready.set()
    while True:
        state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
        sw.save(path, bundle, state, keep_last=2, blocking=False)


def test_sigkill_while_saving_in_the_background_leaves_latest_intact(tmp_path):
    """Killed at random moments (many trials): ``latest`` always names a complete checkpoint
    that verifies and loads."""
    path = tmp_path / "ckpt"
    ctx = process_context()  # a fresh process each trial, forked with torch imported
    rng = random.Random(0)
    killed_with_latest = in_flight = 0
    for _ in range(12):
        ready = ctx.Event()
        proc = ctx.Process(target=saving_forever, args=(str(path), ready))
        proc.start()
        assert ready.wait(60)
        time.sleep(rng.uniform(0.05, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        in_flight += bool(list(path.glob(".tmp.step_*")))  # killed mid-save: left unpublished
        latest = sw.latest_checkpoint(path)
        if latest is None:
            continue
        killed_with_latest += 1
        model = __import__("shardwise.testing", fromlist=["TinyTransformerLM"]).TinyTransformerLM(
            vocab=64, dim=192, heads=4, layers=4)
        bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        state = sw.load(path, bundle)  # verifies every file's checksum first
        assert f"step_{state.step:08d}" == latest.name
    assert killed_with_latest >= 6
    assert in_flight >= 3, in_flight  # the kills did land while files were being written
