# Trackers: W&B, MLflow and trackio offline record the run's config and every metric at its step.
import json
import sqlite3
import time

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import ArgumentError, ConfigError
from shardwise.testing import SyntheticTokens, TinyTransformerLM


class Recording:
    def __init__(self, output="."):
        self.output, self.logged, self.config, self.closed = output, [], None, False

    def init(self, config):
        self.config = dict(config)

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def fitted(trackers, config):
    """Three logged steps of a tiny LM; what a plain recording logger saw beside them."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=1)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   DataLoader(SyntheticTokens(size=24, seq_len=8), batch_size=4))
    recording = Recording()
    sw.fit(bundle, steps=3, log_every=1, progress=False, loggers=[recording, *trackers],
           config=config)
    assert recording.config == config and recording.closed
    return recording.logged


def test_mlflow_and_trackio_record_the_config_and_every_metric_at_its_step(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, no server
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    trackio = pytest.importorskip("trackio")
    project = f"proj-{tmp_path.name}"
    uri = f"file:{tmp_path / 'mlruns'}"
    logged = fitted([sw.MLflowTracker("exp", run_name="r1", tracking_uri=uri),
                     sw.TrackioTracker(project, run_name="r1")], {"lr": 1e-3, "model": "tiny"})
    expected = [(step, name, value) for step, metrics in logged for name, value in metrics.items()]
    assert {name for _, name, _ in expected} >= {"train/loss", "train/lr", "train/tokens_per_s"}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.data.params == {"lr": "0.001", "model": "tiny"}
    for step, name, value in expected:
        history = {h.step: h.value for h in client.get_metric_history(run.info.run_id, name)}
        assert history[step] == pytest.approx(value)

    db = sqlite3.connect(trackio.utils.TRACKIO_DIR / f"{project}.db")
    rows = {step: json.loads(blob) for step, blob in db.execute("select step, metrics from metrics")}
    assert all(rows[step][name] == pytest.approx(value) for step, name, value in expected)
    [(config,)] = db.execute("select config from configs").fetchall()
    assert json.loads(config)["model"] == "tiny"


def test_wandb_offline_records_the_config_and_the_last_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = sw.WandbTracker("proj", run_name="r1", mode="offline", dir=str(tmp_path))
    tracker.init({"lr": 0.1, "layers": 2})
    run = tracker.run
    assert dict(run.config) == {"lr": 0.1, "layers": 2}
    tracker.log({"train/loss": 1.5, "train/mfu": 0.25}, 1)
    tracker.log({"train/loss": 1.0, "train/mfu": 0.375}, 2)
    tracker.close()
    assert tracker.run is None
    [record] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wanted = (b"train/loss", b"train/mfu", b"1.5", b"0.375", b"layers")
    # the offline run: history rows as JSON values, written by wandb's own service process,
    # which may still be flushing when finish() returns (seen: only the header, once in 3)
    deadline = time.monotonic() + 20
    while not all(text in record.read_bytes() for text in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    written = record.read_bytes()
    for text in wanted:
        assert text in written, text


def test_report_to_builds_trackers_by_name_and_one_you_register(tmp_path):
    sw.register_tracker("recording", Recording)
    pipe = sw.from_training_args({"report_to": ["recording", "mlflow"], "output_dir": str(tmp_path),
                                  "learning_rate": 3e-4})
    reporting = pipe.fit_options["report_to"]
    assert [type(r).__name__ for r in reporting] == ["Recording", "MLflowTracker"]
    assert reporting[0].output == str(tmp_path)
    assert "config" not in pipe.fit_options  # fit(config=..., **fit_options) stays valid
    assert reporting[0].config["learning_rate"] == 3e-4  # the arguments, recorded at init
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=1)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   DataLoader(SyntheticTokens(size=8, seq_len=8), batch_size=4))
    recording = reporting[0]
    sw.fit(bundle, config={"seed": 7},
           **{**pipe.fit_options, "report_to": [recording], "steps": 1, "progress": False})
    assert recording.config["learning_rate"] == 3e-4 and recording.config["seed"] == 7
    with pytest.raises(ConfigError, match=r"report_to='neptune' .*recording.*register_tracker"):
        sw.from_training_args({"report_to": "neptune", "output_dir": str(tmp_path)})
    with pytest.raises(ArgumentError, match="'name' must be a non-empty string"):
        sw.register_tracker("all", Recording)
    with pytest.raises(ArgumentError, match="'config' must be a mapping"):
        sw.fit(sw.pipeline(sw.Env())(torch.nn.Linear(2, 2), None, [torch.ones(2)]), steps=1,
               config=[("lr", 1)])
