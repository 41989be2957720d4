# The variables `accelerate launch` sets, read back without launching: the pipeline its YAML builds.
import logging
from pathlib import Path

import pytest
import yaml

import shardwise as sw
from shardwise.errors import ConfigError

ROOT = Path(__file__).parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "fsdp2.yaml").read_text())
#: what `accelerate launch --config_file examples/fsdp2.yaml` sets (Accelerate 1.16, captured)
FSDP2_VARIABLES = {
    "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_FORWARD_PREFETCH": "false", "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_OFFLOAD_PARAMS": "false", "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_SYNC_MODULE_STATES": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_USE_ORIG_PARAMS": "true", "FSDP_VERSION": "2"}
TWO = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def configured(pipe):
    return [s.transform for s in pipe.steps if s.origin == "config"]


def test_the_variables_of_accelerate_launch_build_the_pipeline_of_the_yaml():
    env = sw.detect(environ={**TWO, **FSDP2_VARIABLES})
    assert dict(env.accelerate_variables) == FSDP2_VARIABLES
    from_variables = sw.pipeline(env)
    from_yaml = sw.from_config(EXAMPLE, env=env)
    assert configured(from_variables) == configured(from_yaml) == [
        sw.mixed_precision("bf16"), sw.shard(sw.by_class("LlamaDecoderLayer"))]
    text = from_variables.explain()
    assert "[from accelerate launch's variables]" in text
    assert "ACCELERATE_USE_FSDP=true" in text  # where each setting came from
    # code given in the script takes precedence, as over a config file
    assert configured(sw.pipeline(env, sw.mixed_precision("fp32"))) == [
        sw.shard(sw.by_class("LlamaDecoderLayer"))]


@pytest.mark.parametrize(("variables", "expected"), [
    ({"ACCELERATE_MIXED_PRECISION": "no"}, [sw.mixed_precision("fp32"), sw.replicate()]),
    ({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True",
      "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
     [sw.mixed_precision("bf16"), sw.accumulate_gradients(4), sw.replicate()]),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
      "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op",
      "FSDP_OFFLOAD_PARAMS": "true", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
      "FSDP_MIN_NUM_PARAMS": "1000", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
     [sw.mixed_precision("fp32"), sw.offload(), sw.checkpoint_activations(sw.by_size(1000)),
      sw.shard(sw.by_size(1000), reshard_after_forward=False)]),
    ({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true",
      "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
      "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
      "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"},
     [sw.mixed_precision("bf16"), sw.accumulate_gradients(2), sw.clip_gradients(1.0),
      sw.offload(), sw.shard()]),
])
def test_each_launcher_setting_becomes_its_transform(variables, expected):
    env = sw.detect(environ={**TWO, **variables})
    assert sorted(map(repr, configured(sw.pipeline(env)))) == sorted(map(repr, expected))


def test_use_cpu_puts_the_job_on_the_cpu_and_dynamo_compiles(caplog):
    caplog.set_level(logging.WARNING, "shardwise.configs")
    env = sw.detect(environ={"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no",
                             "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_FOO": "1",
                             "ACCELERATE_DYNAMO_MODE": "max-autotune",
                             "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"})
    assert env.device.type == "cpu"
    pipe = sw.pipeline(env)
    assert sw.compile(backend="inductor", mode="max-autotune",
                      regional=True) in configured(pipe)
    notes = "\n".join(pipe.notes)
    assert "ACCELERATE_FOO is not read by shardwise" in notes
    assert "DYNAMO_BACKEND is not" not in notes and "DYNAMO" not in caplog.text
    with pytest.raises(sw.errors.ConfigError, match=r"ACCELERATE_DYNAMO_BACKEND='TURBO'"):
        sw.pipeline(sw.detect(environ={"ACCELERATE_DYNAMO_BACKEND": "TURBO"}))


def test_only_logging_variables_change_nothing():
    env = sw.detect(environ={"ACCELERATE_LOG_LEVEL": "info"})
    assert all(s.origin != "config" for s in sw.pipeline(env).steps)


@pytest.mark.parametrize(("variables", "message"), [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "3"}, r"FSDP_VERSION=3 is not accepted"),
    ({"ACCELERATE_MIXED_PRECISION": "fp64"}, r"ACCELERATE_MIXED_PRECISION='fp64'"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "EVERYTHING"},
     r"FSDP_AUTO_WRAP_POLICY='EVERYTHING'"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "9"},
     r"ACCELERATE_DEEPSPEED_ZERO_STAGE=9"),
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"},
     r"ACCELERATE_GRADIENT_ACCUMULATION_STEPS='0'"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true"}, r"ACCELERATE_USE_MEGATRON_LM='true'"),
])
def test_a_bad_variable_is_refused_naming_it(variables, message):
    with pytest.raises(ConfigError, match=rf"accelerate launch's variables: {message}"):
        sw.pipeline(sw.detect(environ={**TWO, **variables}))


def test_a_config_file_handed_over_wins_and_says_so(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "mixed_precision": "no"}))
    env = sw.detect(environ={**TWO, "SHARDWISE_CONFIG_FILE": str(path),
                             "ACCELERATE_MIXED_PRECISION": "bf16"})
    pipe = sw.pipeline(env)
    assert configured(pipe) == [sw.mixed_precision("fp32"), sw.replicate()]
    assert any("accelerate launch's variables are not applied" in n for n in pipe.notes)


def test_a_refusal_written_by_the_reader_names_the_variables_too():
    """Not only a value refused by its type: a contradiction the reader words itself names
    the variables that gave the keys (their names travel with the config, nothing is
    rewritten in the message)."""
    mesh = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    with pytest.raises(ConfigError, match=r"accelerate launch's variables: "
                       r"PARALLELISM_CONFIG_CP_SIZE=2 and PARALLELISM_CONFIG_SP_SIZE=2: both"):
        sw.pipeline(sw.detect(environ={**TWO, **mesh, "PARALLELISM_CONFIG_CP_SIZE": "2",
                                       "PARALLELISM_CONFIG_SP_SIZE": "2"}))
    with pytest.raises(ConfigError, match=r"x PARALLELISM_CONFIG_TP_SIZE=4 = 4 ranks, but this "
                       r"run has 2"):
        sw.pipeline(sw.detect(environ={**TWO, **mesh, "PARALLELISM_CONFIG_TP_SIZE": "4"}))
