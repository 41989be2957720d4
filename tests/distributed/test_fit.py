# sw.fit: resumed runs equal uninterrupted ones, Ctrl-C saves, logging and evaluation.
# Its tests that start no process are in tests/unit/test_fit_loop.py.
import os

import torch

import shardwise as sw
from shardwise.testing import full_state, run_distributed

from conftest import build_lm

LAYOUTS = {"replicate": [sw.replicate()], "shard": [sw.shard()]}


def fit_layouts(root, steps, fresh):
    """``fit`` up to ``steps`` optimizer steps per layout, checkpointing under ``root``;
    ``fresh``: seed a new run (a resumed one takes its RNG from the checkpoint)."""
    out = {}
    for name, parts in LAYOUTS.items():
        bundle = build_lm(parts)
        if fresh:
            torch.manual_seed(1234)
        state = sw.fit(bundle, steps=steps, checkpoint_dir=os.path.join(root, name),
                       checkpoint_every=2, log_every=2, progress=False)
        out[name] = (state, full_state(bundle.model))
    return out


def test_fit_stopped_and_resumed_in_new_processes_equals_an_uninterrupted_fit(tmp_path):
    whole = run_distributed(fit_layouts, str(tmp_path / "whole"), 9, True, timeout=300)
    run_distributed(fit_layouts, str(tmp_path / "split"), 5, True, timeout=300)
    resumed = run_distributed(fit_layouts, str(tmp_path / "split"), 9, False, timeout=300)
    for rank in range(2):
        for name in LAYOUTS:
            state, params = whole[rank][name]
            got_state, got = resumed[rank][name]
            assert state.step == 9 and state.epoch == 3  # crossed epoch ends (3 steps each)
            assert got_state == state
            assert all(torch.equal(got[k], params[k]) for k in params), name
    # saved every 2 steps and at the end
    assert sorted(os.listdir(tmp_path / "split" / "shard")) == [
        ".shardwise.lock", "latest", *(f"step_{n:08d}" for n in (2, 4, 5, 6, 8, 9))]


def logged_lines():
    """sw.fit with Python logging at INFO (as Transformers' scripts set it), without and with
    the progress bar; and the rates two ranks of different speeds compute."""
    import logging
    import time

    from shardwise.throughput import Meter

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    keep = Keep()
    logging.getLogger("shardwise").addHandler(keep)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    out = {}
    for progress in (False, True):
        keep.lines.clear()
        sw.fit(build_lm([sw.replicate()]), steps=4, log_every=2, progress=progress)
        out[progress] = [line for line in keep.lines if line.startswith("step ")]
    env = sw.detect()
    meter = Meter(torch.nn.Linear(2, 2), env, 1, None)
    meter.add(4, None)
    time.sleep(0.05 + 0.1 * env.rank)
    out["rates"] = meter.rates()["samples_per_s"]
    return out


def test_fit_logs_each_line_once_and_every_rank_reports_the_same_rates():
    runs = run_distributed(logged_lines, timeout=300)
    assert [line.split(":")[0] for line in runs[0][False]] == ["step 2", "step 4"]
    assert runs[0][True] == []  # above the bar instead, not twice
    assert runs[1][False] == [] and runs[1][True] == []
    assert runs[0]["rates"] == runs[1]["rates"] < 8 / 0.15  # the slowest rank's time
