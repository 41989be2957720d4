# sw.fit in one process: Ctrl-C saves and the resumed run ends as the whole one, loggers, refused arguments.
import os

import pytest
import torch

import shardwise as sw
from shardwise.testing import full_state

from conftest import build_lm


class Recorder:
    def __init__(self):
        self.rows, self.closed = [], False

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def test_fit_logs_evaluates_and_saves_on_ctrl_c(tmp_path):
    def interrupting_eval(bundle):
        if calls.append(1) or len(calls) == 2:
            raise KeyboardInterrupt
        return {"accuracy": 0.5}

    calls, recorder = [], Recorder()
    bundle = build_lm([], accumulate=1)  # one process: 12 batches an epoch
    torch.manual_seed(1234)
    with pytest.raises(KeyboardInterrupt):
        sw.fit(bundle, epochs=2, checkpoint_dir=tmp_path, eval_fn=interrupting_eval,
               eval_every=3, log_every=2, loggers=[recorder], progress=False)
    assert sw.latest_checkpoint(tmp_path).name == "step_00000006"  # saved on Ctrl-C
    assert [step for step, _ in recorder.rows] == [2, 3, 4, 6] and recorder.closed
    assert recorder.rows[1][1] == {"eval/accuracy": 0.5}
    assert set(recorder.rows[0][1]) == {"train/loss", "train/lr", "train/samples_per_s",
                                        "train/tokens_per_s"}  # no MFU: a CPU has no peak
    resumed = build_lm([], accumulate=1)
    state = sw.fit(resumed, epochs=2, checkpoint_dir=tmp_path, progress=False)
    whole = build_lm([], accumulate=1)
    torch.manual_seed(1234)
    expected = sw.fit(whole, epochs=2, progress=False)
    assert state == expected and state.epoch == 2 and state.step == 24
    after, ref = full_state(resumed.model), full_state(whole.model)
    assert all(torch.equal(after[k], ref[k]) for k in ref)


def test_fit_writes_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    bundle = build_lm([], accumulate=1)
    sw.fit(bundle, steps=4, log_every=2, loggers=[sw.TensorBoardLogger(str(tmp_path))],
           progress=True)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs 'epochs' or 'steps'"),
    ({"steps": 0}, "'steps' must be an integer >= 1 or None (got 0)"),
    ({"epochs": 1, "log_every": 1.5}, "'log_every' must be an integer >= 1 or None (got 1.5)"),
])
def test_fit_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sw.fit(build_lm([], accumulate=1), **kwargs)


def test_fit_on_an_empty_loader_says_so():
    from torch.utils.data import DataLoader

    from shardwise.testing import SyntheticRegression, TinyMLP

    model = TinyMLP()
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(SyntheticRegression(size=3), batch_size=4,
                                              drop_last=True))
    with pytest.raises(ValueError, match="yielded no batch in an epoch"):
        sw.fit(bundle, steps=5, progress=False)
