# Accelerate's parallelism_config from YAML, launch variables and TrainingArguments = the code's pipeline.
"""dp_replicate x dp_shard x tp from every source builds the transforms code would write."""

import pytest
import yaml

import shardwise as sw
from shardwise.errors import ConfigError

FOUR = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
FSDP2 = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
         "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
         "fsdp_reshard_after_forward": True}
YAML = {"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 4,
        "fsdp_config": FSDP2,
        "parallelism_config": {"parallelism_config_dp_replicate_size": 1,
                               "parallelism_config_dp_shard_size": 2,
                               "parallelism_config_tp_size": 2,
                               "parallelism_config_cp_size": 1}}
#: what `accelerate launch --config_file` sets for YAML (accelerate.utils.launch)
VARIABLES = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true",
             "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
             "FSDP_RESHARD_AFTER_FORWARD": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
             "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
             "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "1",
             "PARALLELISM_CONFIG_CP_BACKEND": "torch", "PARALLELISM_CONFIG_SP_SIZE": "1",
             "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
CODE = [sw.mixed_precision("fp32"), sw.tensor_parallel(size=2),
        sw.shard(sw.by_class("LlamaDecoderLayer"), reshard_after_forward=True)]


def env(**variables):
    return sw.detect(environ={**FOUR, **variables})


def configured(pipe):
    return sorted((s.transform for s in pipe.steps if s.origin == "config"),
                  key=lambda t: t.stage)


def write(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_variables_code_and_training_args_build_one_pipeline(tmp_path):
    from_yaml = sw.from_config(write(tmp_path, YAML), env=env())
    from_variables = sw.pipeline(env(**VARIABLES))
    code = sw.pipeline(env(), *CODE)
    assert configured(from_yaml) == configured(from_variables) == CODE
    assert [s.transform for s in code.steps if s.origin == "user"] == CODE
    args = {"fsdp": "full_shard", "fsdp_config": {**FSDP2, "version": 2},
            "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}}
    from_args = [t for t in sw.from_training_args(args, env=env()).transforms
                 if t.factory_name in ("tensor_parallel", "shard")]
    assert from_args == CODE[1:]
    for pipe in (from_yaml, from_variables, code):
        assert "mesh: dp_shard=2 x tp=2 over 4 ranks" in pipe.explain()


def test_an_accelerate_parallelism_config_object_is_read():
    accelerate = pytest.importorskip("accelerate.parallelism_config")
    config = accelerate.ParallelismConfig(dp_shard_size=2, tp_size=2)
    pipe = sw.from_training_args({"fsdp": "full_shard", "parallelism_config": config}, env=env())
    assert sw.tensor_parallel(size=2) in pipe.transforms


@pytest.mark.parametrize("name", ["cp", "sp"])
def test_cp_and_sp_sizes_are_context_parallel_from_every_source(tmp_path, name):
    """cp_size (Accelerate's context parallel) and sp_size (DeepSpeed's Ulysses) build
    context_parallel(size=2) beside the FSDP settings' shard(), from the YAML, the launch
    variables and TrainingArguments alike; cp_size's notice says the exchange differs."""
    block = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 1,
             f"parallelism_config_{name}_size": 2}
    code = [sw.mixed_precision("fp32"), sw.context_parallel(size=2),
            sw.shard(sw.by_class("LlamaDecoderLayer"), reshard_after_forward=True)]
    from_yaml = sw.from_config(write(tmp_path, {**YAML, "parallelism_config": block}), env=env())
    variables = {**VARIABLES, "PARALLELISM_CONFIG_TP_SIZE": "1",
                 f"PARALLELISM_CONFIG_{name.upper()}_SIZE": "2"}
    from_variables = sw.pipeline(env(**variables))
    assert configured(from_yaml) == configured(from_variables) == code
    args = {"fsdp": "full_shard", "fsdp_config": {**FSDP2, "version": 2},
            "parallelism_config": {"dp_shard_size": 2, f"{name}_size": 2}}
    from_args = [t for t in sw.from_training_args(args, env=env()).transforms
                 if t.factory_name in ("context_parallel", "shard")]
    assert from_args == code[1:]
    assert "mesh: dp_shard=2 x cp=2 over 4 ranks" in from_yaml.explain()
    said = "runs as sw.context_parallel(method='ulysses')"
    assert (said in from_yaml.explain()) == (name == "cp")
    # cp alone: FSDP2 over the cp ranks (Accelerate's dp_shard_cp)
    alone = {"parallelism_config_tp_size": 1, "parallelism_config_dp_shard_size": 1,
             f"parallelism_config_{name}_size": 4}
    pipe = sw.from_config(write(tmp_path, {**YAML, "parallelism_config": alone}), env=env())
    assert configured(pipe)[1:] == [sw.context_parallel(size=4), code[2]]


def test_replicate_size_is_hsdp_across_nodes():
    two_nodes = sw.Env(world_size=8, local_world_size=4, num_nodes=2, node_rank=0)
    block = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
    pipe = sw.from_training_args({"fsdp": "full_shard", "parallelism_config": block},
                                 env=two_nodes)
    shard = next(t for t in pipe.transforms if t.factory_name == "shard")
    assert shard.replicate_across_nodes
    assert "mesh: dp_replicate=2 x dp_shard=2 x tp=2 over 8 ranks" in pipe.explain()
    # DDP alone when nothing is sharded
    alone = sw.from_training_args({"parallelism_config": {"dp_replicate_size": 4}},
                                  env=sw.Env(world_size=4, local_world_size=1, num_nodes=4))
    assert sw.replicate() in alone.transforms


def test_nothing_asked_changes_nothing():
    ones = {**VARIABLES, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "1"}
    assert configured(sw.pipeline(env(**ones))) == [
        sw.mixed_precision("fp32"), sw.shard(sw.by_class("LlamaDecoderLayer"))]


@pytest.mark.parametrize(("change", "message"), [
    ({"parallelism_config_cp_size": 2}, r"tp_size=2 x .*cp_size=2 = 8 ranks, but this run has 4"),
    ({"parallelism_config_tp_size": 1, "parallelism_config_cp_size": 2,
      "parallelism_config_sp_size": 2}, r"cp_size=2 and .*sp_size=2: both split sequences"),
    ({"parallelism_config_tp_size": 1, "parallelism_config_cp_size": 2,
      "parallelism_config_cp_comm_strategy": "ring"},
     r"parallelism_config_cp_comm_strategy='ring'.*allgather"),
    ({"parallelism_config_tp_size": 1, "parallelism_config_sp_size": 2,
      "parallelism_config_sp_seq_length": 4096}, r"parallelism_config_sp_seq_length=4096"),
    ({"parallelism_config_tp_size": 4}, r"dp_shard_size=2 x .*tp_size=4 = 8 ranks, but this run "
                                        r"has 4"),
    ({"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 1},
     r"dp_replicate_size=2, but this run has 1 node"),
    ({"parallelism_config_tp_size": "two"}, r"parallelism_config_tp_size='two'"),
    ({"parallelism_config_pp_size": 2}, r"parallelism_config_pp_size"),
    # Accelerate has no expert parallelism: a key naming it is refused by name
    ({"parallelism_config_ep_size": 2}, r"unknown key.*parallelism_config_ep_size"),
])
def test_bad_sizes_are_refused_naming_the_key(tmp_path, change, message):
    data = {**YAML, "parallelism_config": {**YAML["parallelism_config"], **change}}
    with pytest.raises(ConfigError, match=message):
        sw.from_config(write(tmp_path, data), env=env())


def test_variables_are_named_in_errors_and_fsdp2_is_required(tmp_path):
    with pytest.raises(ConfigError, match=r"PARALLELISM_CONFIG_CP_SIZE=2"):
        sw.pipeline(env(**{**VARIABLES, "PARALLELISM_CONFIG_CP_SIZE": "2"}))  # beside tp_size
    multi_cpu = {**YAML, "distributed_type": "MULTI_CPU"}
    with pytest.raises(ConfigError, match=r"needs distributed_type: FSDP with "
                                          r"fsdp_config.fsdp_version: 2"):
        sw.from_config(write(tmp_path, multi_cpu), env=env())
    no_shard = {**YAML, "fsdp_config": {**FSDP2, "fsdp_sharding_strategy": "NO_SHARD",
                                        "fsdp_reshard_after_forward": None}}
    no_shard["fsdp_config"].pop("fsdp_reshard_after_forward")
    with pytest.raises(ConfigError, match=r"NO_SHARD"):
        sw.from_config(write(tmp_path, no_shard), env=env())


@pytest.mark.parametrize("size", ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                                  "sp_size"])
def test_two_spellings_of_a_size_that_disagree_are_refused_naming_both(tmp_path, size):
    block = {**YAML["parallelism_config"], f"parallelism_config_{size}": 2, size: 4}
    data = {**YAML, "parallelism_config": block}
    message = (rf"parallelism_config.parallelism_config_{size}=2 and parallelism_config.{size}=4 "
               r"contradict each other \(the same setting, with and without the "
               r"parallelism_config_ prefix\); keep one")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))  # the keys in the order written
    with pytest.raises(ConfigError, match=message):
        sw.from_config(path, env=env())
    # TrainingArguments' dict, with the bare name first: named in the order written
    args = {"fsdp": "full_shard", "parallelism_config": {size: 1, f"parallelism_config_{size}": 2}}
    with pytest.raises(ConfigError, match=rf"parallelism_config.{size}=1 and parallelism_config."
                                          rf"parallelism_config_{size}=2 contradict each other"):
        sw.from_training_args(args, env=env())


def test_two_spellings_of_a_size_that_agree_are_accepted(tmp_path):
    # the same value twice, and a null (unset) that does not hide the other spelling's value
    block = {**YAML["parallelism_config"], "dp_shard_size": 2, "tp_size": None}
    from_yaml = sw.from_config(write(tmp_path, {**YAML, "parallelism_config": block}), env=env())
    assert configured(from_yaml) == CODE


def test_two_spellings_that_disagree_are_refused_beside_deepspeed_too():
    # there only "is a mesh asked for?" is read
    args = {"deepspeed": {"train_micro_batch_size_per_gpu": 1},
            "parallelism_config": {"tp_size": 2, "parallelism_config_tp_size": 4}}
    with pytest.raises(ConfigError, match=r"parallelism_config.tp_size=2 and "
                                          r"parallelism_config.parallelism_config_tp_size=4"):
        sw.from_training_args(args, env=env())


def test_a_pipeline_size_is_refused_naming_where_pipeline_parallel_lives():
    """Accelerate 1.16 has no pp_size; a config that asks for one is told to use code."""
    config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
              "parallelism_config": {"parallelism_config_pp_size": 2}}
    with pytest.raises(ConfigError, match=r"parallelism_config\.parallelism_config_pp_size: "
                                          r"Accelerate's parallelism_config has no pipeline size"):
        sw.from_config(config)
