# from_training_args without ranks: TrainingArguments (or a mapping) -> pipeline + sw.fit settings, refusals.
import dataclasses
import json
import logging

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.configs.training_args import ARGUMENTS, DEFAULTS, per_device_batch
from shardwise.errors import ConfigError
from shardwise.testing import SyntheticTokens, TinyTransformerLM

transformers = pytest.importorskip("transformers")
TrainingArguments = transformers.TrainingArguments

CPU_ONE = sw.Env()
CPU_TWO = sw.Env(world_size=2, local_world_size=2)
GPU_FOUR = sw.Env(world_size=4, local_world_size=4, device="meta",
                  precisions=("fp32", "bf16", "fp16"))


def parts(pipe):
    """The transforms the arguments asked for (not the pipeline's own defaults)."""
    return [s.transform for s in pipe.steps if s.origin == "config"]


def kinds(pipe):
    return {type(t).__name__: t for t in parts(pipe)}


def test_every_training_argument_has_a_meaning_here():
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(ARGUMENTS) == fields, (sorted(fields - set(ARGUMENTS)),
                                      sorted(set(ARGUMENTS) - fields))
    for field in dataclasses.fields(TrainingArguments):
        if field.name in DEFAULTS:
            assert DEFAULTS[field.name] == field.default, field.name


COMBINATIONS = [
    {},
    {"use_cpu": True, "bf16": True, "gradient_accumulation_steps": 4, "max_steps": 100,
     "logging_steps": 10, "save_steps": 50, "save_total_limit": 2},
    {"fsdp": "full_shard auto_wrap", "activation_checkpointing": True,
     "fsdp_config": {"transformer_layer_cls_to_wrap": ["TransformerBlock"]}},
    {"fsdp": "shard_grad_op offload", "fsdp_config": {"fsdp_min_num_params": 1000,
                                                       "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}},
    {"accelerator_config": {"non_blocking": True, "gradient_accumulation_kwargs": {
        "sync_with_dataloader": False}}, "gradient_accumulation_steps": 2,
     "dataloader_pin_memory": False, "seed": 7, "data_seed": 9, "max_grad_norm": 0.0},
    {"ddp_find_unused_parameters": True, "ddp_bucket_cap_mb": 50, "ddp_static_graph": True,
     "ddp_broadcast_buffers": False, "ddp_timeout": 7200, "eval_strategy": "steps",
     "eval_steps": 5, "save_strategy": "no", "disable_tqdm": True, "num_train_epochs": 2},
]


@pytest.mark.parametrize("given", COMBINATIONS, ids=range(len(COMBINATIONS)))
def test_a_mapping_means_what_the_training_arguments_built_from_it_mean(given, tmp_path):
    given = {"output_dir": str(tmp_path), **given}
    from_instance = sw.from_training_args(TrainingArguments(**given), env=CPU_TWO)
    from_mapping = sw.from_training_args(given, env=CPU_TWO)
    assert from_instance.transforms == from_mapping.transforms
    assert from_instance.env == from_mapping.env
    assert dict(from_instance.fit_options) == dict(from_mapping.fit_options)


def test_trainer_defaults_become_fp32_clipping_at_one_and_the_trainers_loop(tmp_path):
    pipe = sw.from_training_args({"output_dir": str(tmp_path)}, env=GPU_FOUR)
    got = kinds(pipe)
    # the Trainer trains fp32 unless asked: not the bf16 a GPU default would choose
    assert got["MixedPrecision"] == sw.mixed_precision("fp32")
    assert got["ClipGradients"] == sw.clip_gradients(1.0)
    assert got["Replicate"] == sw.replicate()
    assert got["DistributeData"] == sw.distribute_data(seed=42, non_blocking=False)
    assert got["BatchCheck"] == per_device_batch(8)
    assert "AccumulateGradients" not in got
    assert dict(pipe.fit_options) == {"epochs": 3, "log_every": 500, "checkpoint_dir":
                                      str(tmp_path), "checkpoint_every": 500, "progress": True}
    assert pipe.env.timeout.total_seconds() == 1800
    assert "resumes from the newest checkpoint" in pipe.explain()
    assert "sw.fit(bundle, **pipe.fit_options): epochs=3" in pipe.explain()


def test_each_distributed_argument_becomes_its_transform(tmp_path):
    pipe = sw.from_training_args({
        "fp16": True, "gradient_accumulation_steps": 3, "max_grad_norm": 0.5,
        "fsdp": "hybrid_shard offload auto_wrap",
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "TransformerBlock",
                        "activation_checkpointing": True},
        "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True,
                                                                "num_steps": 3}},
        "ddp_backend": "gloo", "max_steps": 40, "save_strategy": "no",
        "report_to": "tensorboard", "output_dir": str(tmp_path), "per_device_train_batch_size": 2,
    }, env=GPU_FOUR)
    got = kinds(pipe)
    blocks = sw.by_class("TransformerBlock")
    assert got["Shard"] == sw.shard(blocks, replicate_across_nodes=True, sync_each_batch=True)
    assert got["Offload"] == sw.offload()
    assert got["CheckpointActivations"] == sw.checkpoint_activations(blocks)
    assert got["MixedPrecision"] == sw.mixed_precision("fp16")
    assert got["AccumulateGradients"] == sw.accumulate_gradients(3)
    assert got["ClipGradients"] == sw.clip_gradients(0.5)
    assert got["BatchCheck"] == per_device_batch(2)
    assert pipe.env.backend == "gloo"
    options = dict(pipe.fit_options)
    assert options["steps"] == 40 and "epochs" not in options and "checkpoint_dir" not in options
    assert [repr(x) for x in options["report_to"]] == [f"TensorBoardLogger({str(tmp_path / 'runs')!r})"]
    assert not (tmp_path / "runs").exists()  # opened at the first log, on the main process


def test_fsdp_config_as_a_file_with_prefixes_and_v1_strategy_names(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
                                "fsdp_transformer_layer_cls_to_wrap": ["TransformerBlock"],
                                "fsdp_backward_prefetch": "BACKWARD_PRE"}))
    pipe = sw.from_training_args({"fsdp": True, "fsdp_config": str(path)}, env=CPU_TWO)
    assert kinds(pipe)["Shard"] == sw.shard(sw.by_class("TransformerBlock"),
                                            reshard_after_forward=False)
    assert any("backward_prefetch is decided by FSDP2" in n for n in pipe.notes)


def test_deepspeed_auto_values_take_the_arguments_and_mismatches_name_both(tmp_path):
    ds = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
          "train_batch_size": "auto", "bf16": {"enabled": "auto"}}
    pipe = sw.from_training_args({"deepspeed": ds, "gradient_accumulation_steps": 2,
                                  "max_grad_norm": 0.3, "bf16": True}, env=GPU_FOUR)
    got = kinds(pipe)
    assert got["Shard"] == sw.shard()
    assert got["AccumulateGradients"] == sw.accumulate_gradients(2)
    assert got["ClipGradients"] == sw.clip_gradients(0.3)
    assert got["MixedPrecision"] == sw.mixed_precision("bf16")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ds, "gradient_clipping": 0.5}))
    with pytest.raises(ConfigError, match=r"max_grad_norm=1.0 contradicts gradient_clipping=0.5 "
                                          r"in .*ds.json"):
        sw.from_training_args({"deepspeed": str(path)}, env=GPU_FOUR)
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert kinds(sw.from_training_args({"deepspeed": str(path)}, env=GPU_FOUR))[
        "MixedPrecision"] == sw.mixed_precision("fp32")


@pytest.mark.parametrize(("given", "message"), [
    ({"num_train_epochs": 1.5}, r"num_train_epochs=1.5 is not accepted; accepted: a whole"),
    ({"save_strategy": "epoch"}, r"save_strategy='epoch' .*steps, no \(sw.fit counts"),
    ({"logging_strategy": "epoch"}, r"logging_strategy='epoch'"),
    ({"eval_strategy": "best"}, r"eval_strategy='best'"),
    ({"report_to": "neptune"}, r"report_to='neptune' .*mlflow, tensorboard, trackio, wandb, all, none"),
    ({"learning_rat": 1e-4}, r"unknown argument\(s\) \['learning_rat'\]"),
    ({"bf16": True, "fp16": True}, r"bf16=True and fp16=True; choose one"),
    ({"fsdp": "full_shard", "deepspeed": {}}, r"fsdp and deepspeed are both set"),
    ({"fsdp": "tensor_parallel"}, r"fsdp='tensor_parallel' .*full_shard"),
    ({"accelerator_config": {"split_batches": True}}, r"accelerator_config.split_batches=True"),
    ({"accelerator_config": {"even_batches": False}}, r"even_batches=False .*pads"),
    ({"accelerator_config": {"dispatch_batches": True}}, r"dispatch_batches=True"),
    ({"accelerator_config": {"splitbatches": True}}, r"unknown key\(s\) \['splitbatches'\]"),
    ({"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}},
     r"num_steps=4 contradicts gradient_accumulation_steps=1"),
    ({"average_tokens_across_devices": False}, r"average_tokens_across_devices=False"),
    ({"parallelism_config": {"cp_size": 2, "sp_size": 2}},
     r"parallelism_config.cp_size=2 and parallelism_config.sp_size=2: both split sequences"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0"),
    ({"max_grad_norm": float("nan")}, r"max_grad_norm=nan"),
    ({"ddp_timeout": -1}, r"ddp_timeout=-1"),
    ({"ddp_backend": "tcp"}, r"ddp_backend='tcp'"),
    ({"logging_steps": 0.1}, r"logging_steps=0.1 .*needs max_steps"),
    ({"fp16": True}, r"fp16"),
])
def test_bad_or_unsupported_arguments_are_refused_naming_them(given, message):
    with pytest.raises(ConfigError, match=message):
        sw.from_training_args(given, env=CPU_ONE)


def test_arguments_without_a_meaning_here_give_one_notice_each(caplog, tmp_path):
    caplog.set_level(logging.WARNING, "shardwise.configs")
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-4, warmup_steps=10,
                             dataloader_num_workers=2, push_to_hub=False, tf32=None,
                             resume_from_checkpoint=str(tmp_path / "checkpoint-10"))
    pipe = sw.from_training_args(args, env=CPU_ONE)
    noticed = sorted(n.split(": ")[1].split(" ")[0] for n in pipe.notes
                     if n.startswith("TrainingArguments"))
    assert noticed == ["dataloader_num_workers", "learning_rate", "resume_from_checkpoint",
                       "warmup_steps"]
    assert len(caplog.records) == 4
    # a default left alone asks for nothing
    assert not [n for n in sw.from_training_args(TrainingArguments(str(tmp_path)),
                                                 env=CPU_ONE).notes if "not applied" in n]


def test_the_loaders_batch_size_must_be_the_per_device_batch_size():
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters())
    pipe = sw.from_training_args({"per_device_train_batch_size": 4, "save_strategy": "no"},
                                 env=CPU_ONE)
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size=4 but the loader's "
                                          r"batch_size is 2; build the DataLoader with batch_size=4"):
        pipe(model, opt, DataLoader(SyntheticTokens(size=8, seq_len=8), batch_size=2))
