# sw.fit where it surprised users: what it shows, a finished run, loggers beside fit_options, lr.
import logging

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise._config_source import Source
from shardwise.errors import ConfigError
from shardwise.testing import SyntheticRegression, TinyMLP

ONE = sw.Env()


class Recording:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass


def bundle_of(lr=0.1, size=16):
    torch.manual_seed(0)
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(SyntheticRegression(size), batch_size=4)
    return sw.pipeline(ONE)(model, optimizer, loader, scheduler=scheduler)


def test_each_logging_step_is_shown_above_the_bar_whatever_the_logging_level(capsys):
    sw.fit(bundle_of(), epochs=1, log_every=2, progress=True)
    shown = capsys.readouterr().out
    assert "step 2: train/loss" in shown and "step 4: train/loss" in shown


def test_the_logged_learning_rate_is_the_one_the_step_used():
    recording = Recording()
    sw.fit(bundle_of(), epochs=1, log_every=1, progress=False, loggers=[recording])
    rates = [metrics["train/lr"] for _, metrics in recording.logged]
    assert rates == [0.1, 0.05, 0.025, 0.0125]  # step 1 ran at the initial rate, as logged


def test_a_finished_run_says_so_and_trains_nothing(tmp_path, caplog):
    sw.fit(bundle_of(), steps=3, checkpoint_dir=tmp_path, progress=False)
    again = bundle_of()
    before = [p.detach().clone() for p in again.model.parameters()]
    with caplog.at_level(logging.WARNING):
        state = sw.fit(again, steps=3, checkpoint_dir=tmp_path, progress=False)
    assert state.step == 3
    assert "already complete at optimizer step 3" in caplog.text
    # the state was loaded, and nothing trained after it
    loaded = sw.load(tmp_path, bundle_of())
    assert loaded.step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, again.model.parameters(),
                                                     strict=True))  # the checkpoint's weights


def test_loggers_go_beside_the_ones_fit_options_give(tmp_path):
    pytest.importorskip("tensorboard")
    pipe = sw.from_training_args({"report_to": "tensorboard", "output_dir": str(tmp_path),
                                  "per_device_train_batch_size": 4, "max_steps": 2,
                                  "logging_steps": 1, "save_strategy": "no",
                                  "use_cpu": True}, env=ONE)
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  DataLoader(SyntheticRegression(16), batch_size=4))
    recording = Recording()
    sw.fit(bundle, loggers=[recording], **pipe.fit_options)
    assert [step for step, _ in recording.logged] == [1, 2]
    assert list((tmp_path / "runs").iterdir())  # and TensorBoard's event file was written


def test_an_epoch_strategy_is_refused_with_the_interval_that_gives_one_per_epoch():
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir="out", eval_strategy="epoch",
                                          per_device_train_batch_size=2,
                                          gradient_accumulation_steps=3, use_cpu=True)
    with pytest.raises(ConfigError) as refused:
        sw.from_training_args(args, env=ONE)
    text = str(refused.value)
    assert "eval_strategy='epoch' is not accepted" in text and "IntervalStrategy" not in text
    assert ("once per epoch is eval_steps=ceil(dataset size / (2 per device x 1 rank(s) x 3 "
            "accumulation steps))") in text


def test_a_configs_notices_are_logged_by_one_rank(monkeypatch, caplog):
    for rank, logged in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
        caplog.clear()
        src = Source({}, "cfg.yaml")
        with caplog.at_level(logging.WARNING):
            src.notice("ipex_config", "is not applied")
        assert src.notices == ["cfg.yaml: ipex_config is not applied"]  # explain() has it
        assert ("ipex_config is not applied" in caplog.text) is logged


def test_throughput_and_mfu_are_logged_from_a_hand_count_of_tokens_and_flops():
    """tokens/s over samples/s is the sequence length (both over the same training time);
    MFU is tokens/s x 6 x the parameters outside embeddings over the peak given."""
    from shardwise.testing import SyntheticTokens, TinyTransformerLM
    from shardwise.throughput import flops_per_token

    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    loader = DataLoader(SyntheticTokens(size=32, seq_len=8), batch_size=4)
    bundle = sw.pipeline(ONE)(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    recording = Recording()
    sw.fit(bundle, steps=4, log_every=2, progress=False, loggers=[recording], peak_flops=1e12)
    hand = 6 * sum(p.numel() for name, p in model.named_parameters()
                   if not name.startswith(("embed.", "pos.")))
    assert flops_per_token(model, 8) == hand
    for _, metrics in recording.logged:
        assert metrics["train/tokens_per_s"] == pytest.approx(8 * metrics["train/samples_per_s"])
        assert metrics["train/mfu"] == pytest.approx(metrics["train/tokens_per_s"] * hand / 1e12)
        assert 0 < metrics["train/mfu"] < 1
    regression = Recording()  # (x, y) batches: no tokens, no MFU
    sw.fit(bundle_of(), steps=2, log_every=1, progress=False, loggers=[regression],
           peak_flops=1e12)
    assert set(regression.logged[0][1]) == {"train/loss", "train/lr", "train/samples_per_s"}
    with pytest.raises(ValueError, match="'peak_flops' must be a number > 0"):
        sw.fit(bundle_of(), steps=1, peak_flops=0)


def test_a_transformers_models_flops_per_token_count_attention():
    transformers = pytest.importorskip("transformers")
    from shardwise.throughput import flops_per_token

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    outside = sum(p.numel() for name, p in model.named_parameters()
                  if "embed_tokens" not in name)  # the untied lm_head counts
    assert flops_per_token(model, 16) == 6 * outside + 12 * 2 * 32 * 16
