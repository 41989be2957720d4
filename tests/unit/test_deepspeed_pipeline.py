# sw.deepspeed(config) in one process: "auto" resolved as the Trainer resolves it, contradictions with the
# pipeline refused naming both, the engine chosen and explained.
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.deepspeed_engine.auto import Given, resolve
from shardwise.errors import ArgumentError, CheckpointError, ConfigError, ConflictError
from shardwise.testing import SyntheticTokens

from _deepspeed import FP32, MISSING, _loader, _model, needs_deepspeed


def _given(precision="fp32", by=None, steps=1, steps_by=None, clip=None, clip_by=None):
    return Given(precision, by, steps, steps_by, clip, clip_by)


def test_auto_values_are_resolved_as_transformers_resolves_them():
    class Config:
        hidden_size = 16

    model = _model()
    model.config = Config()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9), eps=1e-7,
                                  weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                           "warmup_max_lr": "auto",
                                                           "warmup_num_steps": 10}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    cfg, precision, steps = resolve(config, "ds.json", given=_given(
        "bf16", "mixed_precision('bf16')", 4, "accumulate_gradients(4)", 1.0,
        "clip_gradients(1.0)"), micro=2, world=8, model=model, optimizer=optimizer)
    assert (precision, steps) == ("bf16", 4)
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["train_batch_size"] == 64
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7,
                                          "weight_decay": 0.1}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                          "warmup_num_steps": 10}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 256
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 230
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert config["train_batch_size"] == "auto"  # the user's mapping is left as it was


def test_the_schedulers_auto_totals_are_the_runs_steps_as_the_trainer_fills_them():
    """total_num_steps = ceil(epochs * optimizer steps per epoch), the steps per epoch from
    the loader's batches per rank (DistributedSampler's split) over the accumulation, a
    partial window counted; warmup_num_steps from a count or a fraction, at least 1."""
    from shardwise.data import shard_loader
    from shardwise.deepspeed_engine.transform import steps_per_epoch

    for size, batch, world, drop in ((37, 4, 2, False), (37, 4, 3, True), (8, 4, 2, False)):
        loader = DataLoader(SyntheticTokens(size=size, seq_len=4), batch_size=batch,
                            drop_last=drop)
        env = sw.Env(world_size=world, rank=world - 1, local_rank=world - 1,
                     local_world_size=world)
        batches = len(shard_loader(loader, env, seed=0))  # what each rank really iterates
        for accumulation in (1, 3):
            assert steps_per_epoch(loader, world, accumulation) == max(
                1, -(-batches // accumulation)), (size, batch, world, drop, accumulation)

    config = {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    loader = _loader(2)  # 32 samples, 2 per batch: 8 batches per rank on 2 ranks
    for transform, expected in (
            (sw.deepspeed(config, epochs=1.5, warmup=0.1), (6, 1)),  # 8 / accumulation 2 = 4
            (sw.deepspeed(config, steps=50, warmup=5), (50, 5)),
            (sw.deepspeed(config, epochs=2, steps=7, warmup=0), (7, 1))):
        total, warmup = transform._schedule(loader, sw.Env(world_size=2), 2)
        assert (total, warmup) == expected
        cfg, _, _ = resolve(config, "ds.json", given=_given(), micro=2, world=2, model=_model(),
                            optimizer=None, schedule=lambda steps, t=total, w=warmup: (t, w))
        assert cfg["scheduler"]["params"]["total_num_steps"] == expected[0]
        assert cfg["scheduler"]["params"]["warmup_num_steps"] == expected[1]
    with pytest.raises(ArgumentError, match="'warmup' must be a count >= 0 or a fraction"):
        sw.deepspeed(config, warmup=2.5)
    with pytest.raises(ArgumentError, match="'epochs' must be a number > 0"):
        sw.deepspeed(config, epochs=0)


@pytest.mark.parametrize(("config", "given", "message"), [
    ({"bf16": {"enabled": True}}, _given("fp32", "mixed_precision('fp32')"),
     r"ds.json: bf16.enabled=True contradicts mixed_precision\('fp32'\) in the pipeline"),
    ({"bf16": {"enabled": False}}, _given("bf16", "mixed_precision('bf16')"),
     r"bf16.enabled=False contradicts mixed_precision\('bf16'\)"),
    ({"gradient_accumulation_steps": 2}, _given(steps=4, steps_by="accumulate_gradients(4)"),
     r"gradient_accumulation_steps=2 contradicts accumulate_gradients\(4\)"),
    ({"gradient_clipping": 0.5}, _given(clip=1.0, clip_by="clip_gradients(1.0)"),
     r"gradient_clipping=0.5 contradicts clip_gradients\(1.0\)"),
    ({"train_micro_batch_size_per_gpu": 4}, _given(),
     r"train_micro_batch_size_per_gpu=4 but the loader's batch_size is 2"),
    ({"train_batch_size": 100}, _given(), r"train_batch_size=100 must equal .* = 16"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, _given(),
     r"zero_optimization.reduce_bucket_size=\"auto\" is filled from the model's config"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}, _given(),
     r"scheduler.params.warmup_num_steps=\"auto\" is the run's length: give it as "
     r"sw.deepspeed\(config, epochs=... or steps=..., warmup=...\)"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, _given(), r"both true"),
    ({"gradient_accumulation_steps": 0}, _given(), r"gradient_accumulation_steps=0"),
    ({"gradient_accumulation_steps": 10**15}, _given(),
     r"gradient_accumulation_steps=1000000000000000 is not accepted; accepted: an integer "
     r"from 1 to"),
    ({"train_micro_batch_size_per_gpu": "four"}, _given(),
     r"train_micro_batch_size_per_gpu='four' is not accepted; accepted: an integer from 1 to"),
    ({"train_batch_size": -3}, _given(), r"train_batch_size=-3 is not accepted; accepted: an integer from 1"),
    ({"bf16": []}, _given(), r"ds.json: bf16=\[\] is not accepted; accepted: a mapping"),
])
def test_contradictions_and_unresolvable_autos_are_refused_naming_both(config, given, message):
    with pytest.raises(ConfigError, match=message):
        resolve(config, "ds.json", given=given, micro=2, world=8, model=_model(),
                optimizer=None)


def test_an_unresolved_auto_is_named_in_a_bounded_message():
    with pytest.raises(ConfigError) as caught:
        resolve({"x" * 100_000: "auto"}, "ds.json", given=_given(), micro=2, world=8,
                model=_model(), optimizer=None)
    assert "cannot be resolved here" in str(caught.value) and len(str(caught.value)) < 1000


def test_a_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ArgumentError, match=r"pip install 'shardwise\[deepspeed\]'"):
        sw.pipeline(sw.Env(), sw.deepspeed(FP32))


@needs_deepspeed
def test_deepspeed_excludes_what_its_config_decides():
    with pytest.raises(ConflictError, match="zero_optimization.stage"):
        sw.pipeline(sw.Env(), sw.deepspeed(FP32), sw.shard_optimizer())
    with pytest.raises(ConflictError, match="offload_optimizer"):
        sw.pipeline(sw.Env(), sw.deepspeed(FP32), sw.offload())
    with pytest.raises(ConflictError, match="both distribute the model"):
        sw.pipeline(sw.Env(), sw.deepspeed(FP32), sw.replicate())
    with pytest.raises(ConflictError, match="on_nonfinite='skip'"):
        model = _model()
        sw.pipeline(sw.Env(), sw.deepspeed(FP32), on_nonfinite="skip")(
            model, torch.optim.AdamW(model.parameters()), _loader(4))
    with pytest.raises(ConfigError, match=r"bf16.enabled=True contradicts mixed_precision"):
        model = _model()
        sw.pipeline(sw.Env(), sw.deepspeed({**FP32, "bf16": {"enabled": True}}),
                    sw.mixed_precision("fp32"))(model, torch.optim.AdamW(model.parameters()),
                                                _loader(4))
    # without a mixed_precision transform the config decides: no pipeline default applies
    pipe = sw.pipeline(sw.Env(), sw.deepspeed({**FP32, "bf16": {"enabled": True}}))
    assert not any(type(t).__name__ == "MixedPrecision" for t in pipe.transforms)


def test_from_config_chooses_the_engine_and_explain_says_which(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", '
                  '"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}')
    native = sw.from_config(ds, env=sw.Env())
    assert not any(type(t).__name__ == "DeepSpeed" for t in native.transforms)
    assert 'engine="deepspeed") runs DeepSpeed\'s own engine' in native.explain()
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                         "deepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 2\n"
                         "  gradient_accumulation_steps: 4\n  offload_optimizer_device: cpu\n")
    if MISSING is not None:
        return
    pipe = sw.from_config(yaml_path, env=sw.Env(), engine="deepspeed")
    [transform] = [t for t in pipe.transforms if type(t).__name__ == "DeepSpeed"]
    assert transform.config == {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": True}, "fp16": {"enabled": False}}
    assert "DeepSpeed's own engine (engine=\"deepspeed\")" in pipe.explain()
    assert not any(type(t).__name__ == "MixedPrecision" for t in pipe.transforms)
    with pytest.raises(ConfigError, match="engine=\"deepspeed\" runs a DeepSpeed config"):
        sw.from_config({"fsdp_version": 2}, env=sw.Env(), engine="deepspeed")
    with pytest.raises(ArgumentError, match="'engine' must be 'native' or 'deepspeed'"):
        sw.from_config(ds, engine="megatron")


@needs_deepspeed
def test_from_training_args_runs_its_deepspeed_config_with_the_engine(tmp_path):
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto",
          "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
    pipe = sw.from_training_args({"deepspeed": ds, "save_strategy": "no",
                                  "gradient_accumulation_steps": 2}, env=sw.Env(),
                                 engine="deepspeed")
    kinds = {type(t).__name__: t for t in pipe.transforms}
    assert kinds["DeepSpeed"].config == ds
    assert kinds["MixedPrecision"] == sw.mixed_precision("fp32")  # the Trainer's default
    assert kinds["AccumulateGradients"] == sw.accumulate_gradients(2)
    assert kinds["ClipGradients"] == sw.clip_gradients(1.0)  # max_grad_norm fills "auto"
    fit = sw.from_training_args({"deepspeed": ds, "output_dir": str(tmp_path)}, env=sw.Env(),
                                engine="deepspeed").fit_options
    assert fit["checkpoint_dir"] == str(tmp_path) and fit["checkpoint_every"] == 500
    with pytest.raises(ConfigError, match="max_grad_norm=1.0 contradicts gradient_clipping=0.5"):
        sw.from_training_args({"deepspeed": {**ds, "gradient_clipping": 0.5},
                               "save_strategy": "no"}, env=sw.Env(), engine="deepspeed")


def test_a_deepspeed_file_that_could_run_code_is_refused(tmp_path):
    from shardwise.deepspeed_engine.engine import check_pickle

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt is refused: it names "
                                              r"\S*system, which could run code"):
        check_pickle(path)
    assert not (tmp_path / "ran").exists()
    torch.save({"module": {"w": torch.ones(2)}, "global_steps": 3}, path)
    check_pickle(path)  # tensors and plain data pass


@needs_deepspeed
def test_a_scheduler_beside_a_config_optimizer_is_refused():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    config = {**FP32, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(ConflictError, match="optimizer block.*scheduler"):
        sw.pipeline(sw.Env(), sw.deepspeed(config))(
            model, optimizer, _loader(4),
            scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    with pytest.raises(ConfigError, match="bfloat16.enabled=True and bf16.enabled=False"):
        resolve({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}}, "ds.json",
                 given=_given(), micro=2, world=8, model=_model(), optimizer=None)
    cfg, precision, _ = resolve({"bfloat16": {"enabled": True}}, "ds.json", given=_given(),
                                micro=2, world=8, model=_model(), optimizer=None)
    assert precision == "bf16" and "bfloat16" not in cfg  # the old name is read, not dropped
