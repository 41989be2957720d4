# from_config / from_ddp_args without ranks: Accelerate YAML, DeepSpeed JSON, fsdp_config, DDP arguments.
import json
import logging
import math
import re

import pytest
import torch
import yaml

import shardwise as sw
from shardwise.configs import read_config
from shardwise.errors import ConfigError
from shardwise.testing import SyntheticTokens, TinyTransformerLM

from conftest import SEED

CPU_ONE = sw.Env()
CPU_TWO = sw.Env(world_size=2, local_world_size=2)
GPU_FOUR = sw.Env(world_size=4, local_world_size=4, device="meta",
                  precisions=("fp32", "bf16", "fp16"))


def parts(pipe):
    """The transforms the config asked for (not the pipeline's own defaults)."""
    return [s.transform for s in pipe.steps if not (s.reason or "").startswith("default")
            and type(s.transform).__name__ not in ("Place", "DistributeData")]


def test_the_seed_accelerate_config_loads_exactly(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(SEED))
    pipe = sw.from_config(path, env=GPU_FOUR)
    assert parts(pipe) == [sw.mixed_precision("bf16"),
                           sw.shard(sw.by_class("LlamaDecoderLayer"), reshard_after_forward=True)]
    text = pipe.explain()
    assert f"from accelerate config {path}" in text
    assert "shard(policy=by_class('LlamaDecoderLayer'), reshard_after_forward=True" in text
    assert "fsdp_cpu_ram_efficient_loading is done by building the model with sw.init_on_meta" \
        in text


@pytest.mark.parametrize("block, expected", [
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, [sw.shard(reshard_after_forward=False)]),
    ({"fsdp_sharding_strategy": 1}, [sw.shard()]),
    ({"fsdp_sharding_strategy": "NO_SHARD"}, [sw.replicate()]),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD"}, [sw.shard(replicate_across_nodes=True)]),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000},
     [sw.shard(sw.by_size(1000))]),
    ({"fsdp_offload_params": True, "fsdp_activation_checkpointing": True,
      "fsdp_transformer_layer_cls_to_wrap": "A,B"},
     [sw.offload(), sw.checkpoint_activations(sw.by_class("A", "B")),
      sw.shard(sw.by_class("A", "B"))]),
])
def test_fsdp_version_1_and_2_keys_map_onto_fsdp2(block, expected):
    pipe = sw.from_config({"distributed_type": "FSDP", "fsdp_config": block}, env=CPU_ONE)
    assert parts(pipe) == expected


def test_transformers_fsdp_config_without_prefixes():
    pipe = sw.from_config({"transformer_layer_cls_to_wrap": ["TinyDecoderBlock"],
                           "reshard_after_forward": False, "use_orig_params": True}, env=CPU_ONE)
    assert parts(pipe) == [sw.shard(sw.by_class("TinyDecoderBlock"), reshard_after_forward=False)]
    assert "<mapping>: use_orig_params is always true under FSDP2" in pipe.explain()


def test_keys_without_meaning_under_fsdp2_give_one_notice_each(caplog):
    block = {"fsdp_use_orig_params": True, "fsdp_sync_module_states": True,
             "fsdp_backward_prefetch": "BACKWARD_PRE"}
    with caplog.at_level(logging.WARNING, logger="shardwise.configs"):
        sw.from_config({"distributed_type": "FSDP", "fsdp_config": block}, env=CPU_ONE)
    assert len(caplog.records) == 3


@pytest.mark.parametrize("config, expected", [
    ({"zero_optimization": {"stage": 0}}, [sw.replicate()]),
    ({"zero_optimization": {"stage": 1}}, [sw.replicate(), sw.shard_optimizer()]),
    ({"zero_optimization": {"stage": 2}}, [sw.shard(reshard_after_forward=False)]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                            "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
      "gradient_accumulation_steps": 4, "gradient_clipping": 1.0},
     [sw.mixed_precision("bf16"), sw.accumulate_gradients(4), sw.clip_gradients(1.0),
      sw.offload(), sw.shard()]),
])
def test_deepspeed_stages_map_onto_native_transforms(tmp_path, config, expected):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert sorted(map(repr, parts(sw.from_config(path, env=GPU_FOUR)))) == \
        sorted(map(repr, expected))


def test_deepspeed_auto_values_and_unapplied_blocks_are_reported():
    config = {"zero_optimization": {"stage": 2, "overlap_comm": True},
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
              "optimizer": {"type": "AdamW"}, "fp16": {"enabled": "auto"}}
    text = sw.from_config(config, env=CPU_TWO).explain()
    assert "optimizer is not applied: the optimizer and scheduler you pass are used" in text
    assert "gradient_accumulation_steps is 'auto'" in text
    assert "zero_optimization.overlap_comm is DeepSpeed tuning" in text


def test_accelerate_deepspeed_block_with_a_contradicting_json(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3},
                                                  "gradient_accumulation_steps": 2}))
    config = {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "ds.json", "gradient_accumulation_steps": 4}}
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 contradicts "
                                          "gradient_accumulation_steps=2 in .*ds.json"):
        sw.from_config(path, env=CPU_ONE)
    config["deepspeed_config"]["gradient_accumulation_steps"] = 2
    path.write_text(yaml.safe_dump(config))
    assert sw.shard() in parts(sw.from_config(path, env=CPU_ONE))


@pytest.mark.parametrize("config, message", [
    ({"distributed_type": "TPU"}, "distributed_type='TPU' is not accepted; accepted: NO, "
                                  "MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED"),
    ({"distributed_type": "NO", "mixed_precision": "fp8"}, "fp8 is not supported"),
    ({"distributed_type": "NO", "num_gpus": 2}, "unknown key(s) ['num_gpus']"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_versio": 2}}, "unknown key(s) ['versio']"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 3}}, "fsdp_version=3"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": "maybe"}},
     "fsdp_reshard_after_forward='maybe' is not accepted; accepted: true or false"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device='nvme'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"zero_optimization": {"stage": 1}, "train_batch_size": 30,
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size=30 must equal train_micro_batch_size_per_gpu (4) x "
     "gradient_accumulation_steps (2) x world size (2) = 16"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable one"),
    ({"something": 1}, "cannot tell the format"),
])
def test_bad_configs_name_the_key_value_and_accepted(config, message):
    with pytest.raises(ConfigError) as info:
        sw.from_config(config, env=CPU_TWO)
    assert message in str(info.value)
    assert str(info.value).startswith("<mapping>: ")  # names the source


def test_bad_files_are_named(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [FSDP\n")
    with pytest.raises(ConfigError, match="broken.yaml is not valid YAML"):
        sw.from_config(broken)
    with pytest.raises(ConfigError, match="cannot read config file"):
        sw.from_config(tmp_path / "missing.yaml")


def test_from_ddp_args_maps_transformers_settings():
    pipe = sw.from_ddp_args(ddp_backend="gloo", ddp_find_unused_parameters=True,
                            ddp_bucket_cap_mb=50, ddp_timeout=7200, env=CPU_TWO)
    assert sw.replicate(bucket_mb=50, find_unused_parameters=True) in pipe.transforms
    assert pipe.env.timeout.total_seconds() == 7200 and pipe.env.backend == "gloo"
    with pytest.raises(ConfigError, match="ddp_backend='nccl2' is not accepted"):
        sw.from_ddp_args(ddp_backend="nccl2")


def test_deepspeed_batch_sizes_are_checked_against_the_loader_and_auto_resolved():
    config = {"zero_optimization": {"stage": 0}, "train_batch_size": 8,
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    pipe = sw.from_config(config, env=CPU_ONE)
    assert ("train_micro_batch_size_per_gpu: the loader's batch_size, accumulation 2, total 8"
            in pipe.explain())

    def loader(batch_size):
        return torch.utils.data.DataLoader(SyntheticTokens(size=16), batch_size=batch_size)

    model = TinyTransformerLM()
    pipe(model, torch.optim.SGD(model.parameters(), lr=0.1), loader(4))  # 4 x 2 x 1 = 8
    with pytest.raises(ConfigError, match=r"train_batch_size=8 must equal the micro batch \(3\)"):
        pipe(TinyTransformerLM(), None, loader(3))
    fixed = sw.from_config({**config, "train_micro_batch_size_per_gpu": 4}, env=CPU_ONE)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=4 but the loader's "
                                          "batch_size is 2"):
        fixed(TinyTransformerLM(), None, loader(2))


def test_more_accelerate_keys_are_taken_with_notices_and_contradictions_refused(tmp_path):
    config = {"distributed_type": "DEEPSPEED", "mixed_precision": None,
              "ipex_config": {"ipex": True}, "tpu_use_cluster": False,
              "deepspeed_config": {"zero_stage": 2, "deepspeed_hostfile": "hosts"}}
    text = sw.from_config(config, env=CPU_ONE).explain()
    assert "ipex_config is not applied" in text and "deepspeed_hostfile has no meaning" in text
    assert "tpu_use_cluster" not in text  # what accelerate config writes for "not used"
    assert "ipex_config" not in sw.from_config({**config, "ipex_config": {}},
                                               env=CPU_ONE).explain()
    (tmp_path / "ds.json").write_text(json.dumps({"bf16": {"enabled": True},
                                                  "gradient_clipping": 1.0}))
    yaml_config = tmp_path / "acc.yaml"
    for extra, message in (({"mixed_precision": "fp16"}, "mixed_precision='fp16' contradicts"),
                           ({"deepspeed_config": {"deepspeed_config_file": "ds.json",
                                                  "gradient_clipping": 0.5}},
                            "gradient_clipping=0.5 contradicts gradient_clipping=1.0")):
        data = {"distributed_type": "DEEPSPEED",
                "deepspeed_config": {"deepspeed_config_file": "ds.json"}, **extra}
        yaml_config.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=message):
            sw.from_config(yaml_config, env=GPU_FOUR)


def test_no_wrap_shards_the_whole_model_as_one_group():
    pipe = sw.from_config({"distributed_type": "FSDP",
                           "fsdp_config": {"fsdp_auto_wrap_policy": "NO_WRAP"}}, env=CPU_ONE)
    assert parts(pipe) == [sw.shard(sw.policies.root_only())]
    with pytest.raises(ConfigError, match="NO_WRAP names no blocks to checkpoint"):
        sw.from_config({"distributed_type": "FSDP", "fsdp_config": {
            "fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_activation_checkpointing": True}})


@pytest.mark.parametrize("block, expected", [
    ({"fsdp_reshard_after_forward": "NO_SHARD"}, [sw.replicate()]),  # what FSDP v1 configs write
    ({"fsdp_sharding_strategy": "NO_SHARD", "fsdp_activation_checkpointing": True,
      "fsdp_transformer_layer_cls_to_wrap": "A"},
     [sw.checkpoint_activations(sw.by_class("A")), sw.replicate()]),
])
def test_no_shard_in_either_key_means_replicate_with_its_settings(block, expected):
    pipe = sw.from_config({"distributed_type": "FSDP", "fsdp_config": block}, env=CPU_ONE)
    assert parts(pipe) == expected


@pytest.mark.parametrize("block, message", [
    ({"fsdp_sharding_strategy": "NO_SHARD", "fsdp_offload_params": True},
     "NO_SHARD with fsdp_config.fsdp_offload_params=true: offload needs a sharded strategy"),
    ({"fsdp_offload_params": True, "offload_params": False},
     "fsdp_config.fsdp_offload_params=True and fsdp_config.offload_params=False contradict"),
    ({"fsdp_offload_params": True, "fsdp_cpu_offload": False},
     "fsdp_config.fsdp_offload_params=True and fsdp_config.fsdp_cpu_offload=False contradict"),
    ({"fsdp_sharding_strategy": "NO_SHARD", "fsdp_reshard_after_forward": "FULL_SHARD"},
     "fsdp_config.fsdp_sharding_strategy=NO_SHARD and fsdp_config.fsdp_reshard_after_forward=FULL_SHARD "
     "contradict"),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": True},
     "fsdp_config.fsdp_reshard_after_forward=True contradicts "
     "fsdp_config.fsdp_sharding_strategy=SHARD_GRAD_OP"),
])
def test_contradicting_fsdp_keys_are_refused_naming_both(block, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        sw.from_config({"distributed_type": "FSDP", "fsdp_config": block}, env=CPU_ONE)


@pytest.mark.parametrize("name, content, message", [
    ("ds.json", '{"gradient_clipping": 1.0, "gradient_clipping": 0}', "'gradient_clipping' appears twice"),
    ("c.yaml", "distributed_type: MULTI_CPU\ndistributed_type: NO\n", "'distributed_type' appears twice"),
    ("c.yaml", "a: &x [1, 2]\nb: *x\n", "alias *x"),
    ("ds.json", '{"gradient_clipping": NaN}', "gradient_clipping=nan is not accepted"),
    ("ds.json", '{"gradient_clipping": -1}', "gradient_clipping=-1 is not accepted"),
    ("c.yaml", "x: " + "[" * 40 + "]" * 40 + "\n", "nested more than 16 levels"),
])
def test_config_files_are_read_strictly(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        sw.from_config(path, env=CPU_ONE)


def test_config_files_that_are_not_utf8_or_too_large_name_themselves(tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"distributed_type: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c\.yaml is not UTF-8 text"):
        sw.from_config(binary, env=CPU_ONE)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (5 * 2**20))
    with pytest.raises(ConfigError, match=r"big\.yaml is more than \d+ bytes; a config file may hold"):
        sw.from_config(big, env=CPU_ONE)


def write(tmp_path, name, config):
    """``config`` written to ``tmp_path/name`` as JSON or YAML; the path."""
    path = tmp_path / name
    path.write_text(json.dumps(config) if name.endswith(".json") else yaml.safe_dump(config))
    return path


def refusal(source, env=CPU_ONE):
    """The message of the ConfigError ``from_config(source)`` raises."""
    with pytest.raises(ConfigError) as info:
        sw.from_config(source, env=env)
    return str(info.value)


@pytest.mark.parametrize("name, config, named", [
    ("ds.json", {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}},
     "zero_optimization.offload_optimizer='cpu' is not accepted; accepted: a mapping"),
    ("ds.json", {"fp16": True}, "fp16=True is not accepted; accepted: a mapping like"),
    ("ds.json", {"zero_optimization": [2]}, "zero_optimization=[2] is not accepted"),
    ("ds.json", {"bf16": {"enabled": "yes"}}, "bf16.enabled='yes' is not accepted"),
    ("ds.json", {"zero_optimization": {"stage": 2}, "optimizer": "AdamW"}, "optimizer='AdamW'"),
    ("ds.json", {"zero_optimization": {"stage": 3, "offload_param": {"device": True}}},
     "zero_optimization.offload_param.device=True is not accepted"),
    ("c.yaml", {"distributed_type": "FSDP", "fsdp_config": "FULL_SHARD"},
     "fsdp_config='FULL_SHARD' is not accepted; accepted: a mapping"),
    ("c.yaml", {"distributed_type": "DEEPSPEED", "deepspeed_config": True},
     "deepspeed_config=True is not accepted"),
    ("c.yaml", {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": ["ds.json"]}}, "deepspeed_config.deepspeed_config_file=['ds.json']"),
    ("c.yaml", {"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_transformer_layer_cls_to_wrap": [1, 2]}},
     "fsdp_config.fsdp_transformer_layer_cls_to_wrap=[1, 2]"),
    ("c.yaml", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": [1]}},
     "fsdp_config.fsdp_sharding_strategy=[1]"),
    ("c.yaml", {"distributed_type": "NO", "mixed_precision": ["bf16"]}, "mixed_precision=['bf16']"),
    ("c.yaml", {"distributed_type": "NO", "gpu_ids": {"a": 1}}, "gpu_ids={'a': 1}"),
    ("c.yaml", {"distributed_type": "NO", "dynamo_config": "inductor"}, "dynamo_config='inductor'"),
    ("fsdp.json", {"transformer_layer_cls_to_wrap": "A", "xla_fsdp_settings": 3},
     "xla_fsdp_settings=3"),
])
def test_a_block_or_value_of_the_wrong_shape_is_refused_naming_key_and_file(tmp_path, name, config,
                                                                           named):
    path = write(tmp_path, name, config)
    message = refusal(path)
    assert message.startswith(f"{path}: ") and named in message


def test_a_huge_value_is_shown_as_a_short_excerpt():
    for value in ("x" * 100_000, list(range(100_000)), 10**5000):
        message = refusal({"zero_optimization": {"stage": value}})
        assert "zero_optimization.stage=" in message and len(message) < 200


@pytest.mark.parametrize("config, named", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": math.nan}},
     "zero_optimization.reduce_bucket_size=nan"),
    ({"zero_optimization": {"stage": 2, "allgather_bucket_size": -1}},
     "zero_optimization.allgather_bucket_size=-1"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": math.inf}},
     "zero_optimization.stage3_prefetch_bucket_size=inf"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": -5}}},
     "zero_optimization.offload_param.buffer_size=-5"),
    ({"fp16": {"enabled": True, "loss_scale_window": math.nan}}, "fp16.loss_scale_window=nan"),
    ({"gradient_clipping": -math.inf}, "gradient_clipping=-inf"),
    ({"gradient_clipping": 1.0, "gradient_accumulation_steps": -2}, "gradient_accumulation_steps=-2"),
    ({"gradient_clipping": 1.0, "gradient_accumulation_steps": math.nan},
     "gradient_accumulation_steps=nan"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0"),
    ({"train_batch_size": 2.5}, "train_batch_size=2.5"),
    ({"distributed_type": "NO", "num_processes": -1}, "num_processes=-1"),
    ({"distributed_type": "NO", "num_processes": math.inf}, "num_processes=inf"),
    ({"distributed_type": "NO", "num_machines": math.nan}, "num_machines=nan"),
    ({"distributed_type": "NO", "main_process_port": 70000}, "main_process_port=70000"),
    ({"distributed_type": "NO", "num_machines": 2, "num_processes": 4, "machine_rank": 2},
     "machine_rank=2"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"gradient_clipping": math.nan}},
     "deepspeed_config.gradient_clipping=nan"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"gradient_accumulation_steps": 0}},
     "deepspeed_config.gradient_accumulation_steps=0"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                                                  "fsdp_min_num_params": -5}},
     "fsdp_config.fsdp_min_num_params=-5"),
])
def test_nan_infinite_and_negative_numbers_are_refused_naming_the_key(config, named):
    message = refusal(config)
    assert message.startswith("<mapping>: ") and named in message


@pytest.mark.parametrize("argument, value", [
    ("ddp_bucket_cap_mb", math.nan), ("ddp_bucket_cap_mb", -25), ("ddp_bucket_cap_mb", math.inf),
    ("ddp_timeout", math.inf), ("ddp_timeout", -1), ("ddp_timeout", 0), ("ddp_timeout", "1800"),
    ("ddp_find_unused_parameters", "yes"), ("ddp_broadcast_buffers", 1),
])
def test_ddp_arguments_of_the_wrong_type_or_range_are_refused_naming_them(argument, value):
    with pytest.raises(ConfigError, match=rf"^from_ddp_args\(\): {argument}="):
        sw.from_ddp_args(**{argument: value}, env=CPU_TWO)


@pytest.mark.parametrize("block, file, named", [
    ({"zero_stage": 3, "offload_optimizer_device": "cpu"}, {"zero_optimization": {"stage": 0}},
     ("deepspeed_config.zero_stage=3", "zero_optimization.stage=0")),
    ({"zero_stage": 3, "offload_optimizer_device": "cpu"},
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}},
     ("deepspeed_config.offload_optimizer_device='cpu'",
      "zero_optimization.offload_optimizer.device='none'")),
    ({"offload_param_device": "none"},
     {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     ("deepspeed_config.offload_param_device='none'", "zero_optimization.offload_param.device='cpu'")),
    ({"gradient_clipping": 0.5}, {"gradient_clipping": 1.0},
     ("deepspeed_config.gradient_clipping=0.5", "gradient_clipping=1.0")),
    ({"gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 2},
     ("deepspeed_config.gradient_accumulation_steps=4", "gradient_accumulation_steps=2")),
    ({"mixed_precision": "bf16"}, {"fp16": {"enabled": True}},
     ("mixed_precision='bf16'", "fp16.enabled=True")),
    ({"mixed_precision": "fp16"}, {"fp16": {"enabled": False}},
     ("mixed_precision='fp16'", "fp16.enabled=False")),
])
def test_the_yaml_deepspeed_block_and_its_file_must_agree_on_every_setting(tmp_path, block, file,
                                                                        named):
    ds = write(tmp_path, "ds.json", {"train_micro_batch_size_per_gpu": "auto", **file})
    precision = block.pop("mixed_precision", "no")
    path = write(tmp_path, "acc.yaml", {
        "distributed_type": "DEEPSPEED", "mixed_precision": precision,
        "deepspeed_config": {**block, "deepspeed_config_file": "ds.json"}})
    message = refusal(path, env=GPU_FOUR)
    assert message.startswith(f"{path}: {named[0]} contradicts {named[1]} in {ds}")


def test_the_yaml_deepspeed_block_fills_what_its_file_leaves_out_or_auto(tmp_path, caplog):
    write(tmp_path, "ds.json", {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                                "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                                "zero_optimization": {"offload_optimizer": {"pin_memory": True}}})
    path = write(tmp_path, "acc.yaml", {
        "distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "deepspeed_config": {
            "deepspeed_config_file": "ds.json", "zero_stage": 3, "offload_optimizer_device": "cpu",
            "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}})
    with caplog.at_level(logging.WARNING, logger="shardwise.configs"):
        pipe = sw.from_config(path, env=GPU_FOUR)
    assert sorted(map(repr, parts(pipe))) == sorted(map(repr, [
        sw.mixed_precision("bf16"), sw.accumulate_gradients(4), sw.clip_gradients(1.0),
        sw.offload(), sw.shard()]))
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'ds.json'}: zero_optimization.offload_optimizer.pin_memory is DeepSpeed "
        "tuning with no FSDP2 counterpart"]  # no "auto" left: the YAML gave each


def test_nvme_is_refused_beside_a_deepspeed_config_file(tmp_path):
    write(tmp_path, "ds.json", {"zero_optimization": {"stage": 0}})
    block = {"zero_stage": 3, "offload_optimizer_device": "nvme", "deepspeed_config_file": "ds.json"}
    path = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "deepspeed_config": block})
    assert "deepspeed_config.offload_optimizer_device='nvme' is not accepted" in refusal(path)
    block.update(offload_optimizer_device="none", offload_param_nvme_path="/local_nvme")
    path = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "deepspeed_config": block})
    assert "deepspeed_config.offload_param_nvme_path='/local_nvme'" in refusal(path)


def test_offload_with_a_low_zero_stage_names_both_settings(tmp_path):
    write(tmp_path, "ds.json", {"zero_optimization": {"stage": 1}})
    path = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "ds.json", "offload_param_device": "cpu"}})
    assert refusal(path).startswith(
        f"{path}: deepspeed_config.offload_param_device='cpu' needs ZeRO stage 2 or 3 (shard), "
        f"but zero_optimization.stage=1 in {tmp_path / 'ds.json'}")


@pytest.mark.parametrize("config, named", [
    ({"fsdp_version": 2, "version": 1}, "fsdp_version=2 and version=1 contradict"),
    ({"fsdp_sharding_strategy": 1, "sharding_strategy": "1"},
     "fsdp_sharding_strategy=1 and sharding_strategy='1' contradict"),
    ({"cpu_offload": True, "offload_params": False}, "offload_params=False and cpu_offload=True"),
    ({"min_num_params": 1000, "transformer_layer_cls_to_wrap": "A"},
     "min_num_params=1000 and transformer_layer_cls_to_wrap ask for two wrapping policies"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                            "stage3_gather_fp16_weights_on_model_save": False}},
     "zero_optimization.stage3_gather_16bit_weights_on_model_save=True and "
     "zero_optimization.stage3_gather_fp16_weights_on_model_save=False contradict"),
])
def test_two_names_for_one_setting_that_disagree_are_refused_naming_both(config, named):
    assert named in refusal(config)


def test_the_same_setting_twice_with_one_value_is_taken():
    config = {"fsdp_version": 2, "version": 2, "fsdp_offload_params": True, "cpu_offload": True}
    assert parts(sw.from_config(config, env=CPU_ONE)) == [sw.offload(), sw.shard()]


def test_a_transformers_fsdp_config_with_min_num_params_wraps_by_size():
    assert parts(sw.from_config({"min_num_params": 5000}, env=CPU_ONE)) == [
        sw.shard(sw.by_size(5000))]
    assert parts(sw.from_config({"min_num_params": 0, "use_orig_params": True}, env=CPU_ONE)) == [
        sw.shard()]


def test_every_key_not_applied_gives_exactly_one_notice():
    config = {"distributed_type": "MULTI_GPU", "debug": True, "enable_cpu_affinity": True,
              "main_training_function": "train", "tpu_name": "pod",
              "fp8_config": {"backend": "TE"}, "downcast_bf16": "yes",
              "fsdp_config": {"fsdp_version": 2}}
    notices = read_config(config, env=CPU_ONE).notices
    for key in ("debug", "enable_cpu_affinity", "main_training_function", "tpu_name",
                "fp8_config", "downcast_bf16", "fsdp_config"):
        assert sum(n.startswith(f"<mapping>: {key} ") for n in notices) == 1, (key, notices)
    assert len(notices) == 7
    # what accelerate config writes for a setting not used asks for nothing
    quiet = {**config, "fp8_config": {}, "downcast_bf16": "no", "tpu_use_sudo": False}
    assert len(read_config(quiet, env=CPU_ONE).notices) == 5
    fsdp = {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 10,
            "fsdp_transformer_layer_cls_to_wrap": "A"}
    assert read_config({"distributed_type": "FSDP", "fsdp_config": fsdp}, env=CPU_ONE).notices == (
        "<mapping>: fsdp_config.fsdp_transformer_layer_cls_to_wrap is not used with "
        "SIZE_BASED_WRAP",)
    ds = {"fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    assert [n.split(": ")[1].split()[0] for n in read_config(ds, env=CPU_ONE).notices] == [
        "zero_optimization.offload_param.pin_memory", "fp16.initial_scale_power", "fp16.loss_scale"]


@pytest.mark.parametrize("config, named", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "bogus": 1}}},
     "unknown key(s) ['bogus'] in zero_optimization.offload_param"),
    ({"fp16": {"enabled": True, "bogus": 1}}, "unknown key(s) ['bogus'] in fp16"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"bogus": 1}},
     "unknown key(s) ['bogus'] in deepspeed_config"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_bogus": None}},
     "unknown key(s) ['bogus'] in fsdp_config"),
])
def test_unknown_keys_in_any_block_are_refused_naming_the_block(config, named):
    assert named in refusal(config)


def test_a_config_the_env_cannot_run_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, "ds.json", {"fp16": {"enabled": True}})
    message = refusal(path, env=CPU_ONE)
    assert message.startswith(f"{path}: ") and "fp16" in message


def test_unquoted_no_in_a_yaml_file_means_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: NO\nmixed_precision: no\n")
    # Accelerate's "no" is full precision, said explicitly: fp32, not the device's default
    assert parts(sw.from_config(path, env=CPU_ONE)) == [sw.mixed_precision("fp32")]


def test_sources_that_are_not_config_files_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="a config source is a path or a mapping"):
        sw.from_config(3)
    with pytest.raises(ConfigError, match=f"cannot read config file {tmp_path}: not a regular file"):
        sw.from_config(tmp_path)
    keyed = tmp_path / "c.yaml"
    keyed.write_text("distributed_type: FSDP\nfsdp_config:\n  1: FULL_SHARD\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: the key 1 is not a string"):
        sw.from_config(keyed)
    with pytest.raises(ConfigError, match="<mapping>: the key 1 is not a string"):
        sw.from_config({"distributed_type": "FSDP", "fsdp_config": {1: "FULL_SHARD"}})
