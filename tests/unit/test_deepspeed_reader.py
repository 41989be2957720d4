# One DeepSpeed config reader, two outputs: the same value means the same, and is refused the same, on both.
import json

import pytest
import torch

import shardwise as sw
from shardwise.deepspeed_engine.auto import Given, resolve
from shardwise.errors import ConfigError

GPU_FOUR = sw.Env(world_size=4, local_world_size=4, device="meta", backend="nccl",
                  precisions=("fp32", "bf16", "fp16"))
DEFAULT = Given("fp32", None, 1, None, None, None)


def native(config):
    """The first output: native transforms (a ``ds_config.json`` read by ``from_config``,
    which recognises one by its ``zero_optimization`` block)."""
    return sw.from_config({"zero_optimization": {}, **config}, env=GPU_FOUR)


def engine(config, given=DEFAULT):
    """The second output: the JSON DeepSpeed's engine runs."""
    return resolve({"zero_optimization": {}, **config}, "ds.json", given=given, micro=2, world=4,
                   model=torch.nn.Linear(2, 2), optimizer=None)


def verdict(build, config):
    """None when accepted, else the refused key and value as the message names them."""
    try:
        build(config)
    except ConfigError as exc:
        return str(exc).split(": ", 1)[1].split(" ", 1)[0]
    return None


@pytest.mark.parametrize("config", [
    {"zero_optimization": {"stage": 4}},
    {"zero_optimization": {"stage": "two"}},
    {"zero_optimization": {"stage": True}},
    {"fp16": {"enabled": 1}},
    {"bf16": {"enabled": "yes"}},
    {"bf16": []},
    {"gradient_accumulation_steps": 0},
    {"gradient_accumulation_steps": 2**40},
    {"gradient_accumulation_steps": 2.5},
    {"train_micro_batch_size_per_gpu": "two"},
    {"gradient_clipping": -1.0},
    {"gradient_clipping": float("nan")},
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}},
    {"bfloat16": {"enabled": True}, "bf16": {"enabled": False}},
])
def test_a_bad_value_is_refused_naming_the_same_key_by_both_outputs(config):
    refused = verdict(native, config)
    assert refused is not None and refused == verdict(engine, config), refused


@pytest.mark.parametrize(("config", "precision", "steps"), [
    ({"bfloat16": {"enabled": True}}, "bf16", 1),  # the old name, on both
    ({"fp16": {"enabled": "true"}}, "fp16", 1),  # written as a string
    ({"gradient_accumulation_steps": "4", "bf16": {"enabled": "auto"}}, "fp32", 4),
    ({"gradient_accumulation_steps": 2.0}, "fp32", 2),
])
def test_a_value_means_the_same_to_both_outputs(config, precision, steps):
    kinds = {type(t).__name__: t for t in native(config).transforms}
    native_precision = kinds["MixedPrecision"].precision if "MixedPrecision" in kinds else "fp32"
    native_steps = kinds["AccumulateGradients"].steps if "AccumulateGradients" in kinds else 1
    cfg, engine_precision, engine_steps = engine(config)
    assert (native_precision, native_steps) == (engine_precision, engine_steps) == (
        precision, steps)
    assert cfg["gradient_accumulation_steps"] == steps and "bfloat16" not in cfg


def test_every_contradiction_is_refused_by_one_rule_in_one_form(tmp_path):
    """The config against the pipeline, an Accelerate block against its file, and
    TrainingArguments against its file: the same sentence, naming both and where "auto"
    would go."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    with pytest.raises(ConfigError) as pipeline:
        engine({"gradient_accumulation_steps": 2},
               Given("fp32", None, 4, "accumulate_gradients(4)", None, None))
    with pytest.raises(ConfigError) as block:
        sw.from_config({"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_config_file": str(ds), "gradient_accumulation_steps": 4}}, env=GPU_FOUR)
    for engine_name in ("native", "deepspeed"):
        with pytest.raises(ConfigError) as trainer:
            sw.from_training_args({"deepspeed": str(ds), "gradient_accumulation_steps": 4},
                                  env=GPU_FOUR, engine=engine_name)
        assert str(trainer.value) == (
            f"training arguments <mapping>: gradient_accumulation_steps=4 contradicts "
            f"gradient_accumulation_steps=2 in {ds}; set it in one place (or \"auto\" in {ds})")
    assert str(pipeline.value) == (
        "ds.json: gradient_accumulation_steps=2 contradicts accumulate_gradients(4) in the "
        "pipeline; set it in one place (or \"auto\" in the config)")
    assert "deepspeed_config.gradient_accumulation_steps=4 contradicts " \
           f"gradient_accumulation_steps=2 in {ds}; set it in one place" in str(block.value)


def test_deepspeeds_engine_is_refused_a_bad_value_when_the_arguments_are_read():
    """Before, a stage DeepSpeed cannot run reached deepspeed.initialize; now the reader
    refuses it when TrainingArguments are read, as the native mapping does."""
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=7 is not accepted; "
                                          r"accepted: an integer from 0 to 3"):
        sw.from_training_args({"deepspeed": {"zero_optimization": {"stage": 7}}},
                              env=GPU_FOUR, engine="deepspeed")
    # nvme offload is DeepSpeed's to run: its engine takes it, the native mapping refuses it
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert engine(nvme)[0]["zero_optimization"]["offload_param"]["device"] == "nvme"
    with pytest.raises(ConfigError, match="nvme offload is not supported"):
        native(nvme)
