# TrainingArguments' fields: their defaults here, and what each one becomes (the table docs show).
"""The field table of ``TrainingArguments``: :data:`DEFAULTS`, :data:`ARGUMENTS` (every field
and what it becomes), :data:`NOTICED` (fields with no meaning here, each with why)."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "ARGUMENTS", "NOTICED", "plain_value"]

#: TrainingArguments' defaults for the fields that have an effect here (checked by a test)
DEFAULTS: dict[str, Any] = {
    "output_dir": None, "per_device_train_batch_size": 8, "num_train_epochs": 3.0,
    "max_steps": -1, "gradient_accumulation_steps": 1, "average_tokens_across_devices": True,
    "max_grad_norm": 1.0, "bf16": False, "fp16": False, "activation_checkpointing": None,
    "gradient_checkpointing": None, "logging_strategy": "steps", "logging_steps": 500,
    "disable_tqdm": None, "report_to": "none", "eval_strategy": "no", "eval_steps": None,
    "save_strategy": "steps", "save_steps": 500, "save_total_limit": None, "seed": 42,
    "data_seed": None, "use_cpu": False, "accelerator_config": None,
    "dataloader_pin_memory": True, "ddp_find_unused_parameters": None,
    "ddp_bucket_cap_mb": None, "ddp_broadcast_buffers": None, "ddp_static_graph": None,
    "ddp_backend": None, "ddp_timeout": 1800, "fsdp": None, "fsdp_config": None,
    "deepspeed": None, "resume_from_checkpoint": None}


_OPT = "is not applied: the optimizer you pass to the pipeline is used (build it with this value)"
_SCHED = "is not applied: the scheduler you pass to the pipeline is used"
_LOADER = "is not applied: it belongs to the DataLoader you build (pass it there)"
_TRAINER = "is the Trainer's own and is not applied here"
_HUB = "is the Trainer's Hub upload and is not applied (push with sw.export + huggingface_hub)"
_EVAL = "is the Trainer's evaluation loop and is not applied (write eval_fn for sw.fit)"

#: every TrainingArguments field: what it becomes here (the table in docs/training-args.md)
ARGUMENTS: dict[str, str] = {
    # distribution
    "fsdp": "true, or the strings full_shard / shard_grad_op / hybrid_shard / offload / "
            "auto_wrap: shard() (+ offload()) with fsdp_config",
    "fsdp_config": "path or dict, with or without fsdp_ prefixes, v1 and v2 keys: read as "
                   "sw.from_config reads a Transformers fsdp_config (shard, offload, "
                   "checkpoint_activations)",
    "deepspeed": "path or dict: read as sw.from_config reads a DeepSpeed JSON; its \"auto\" "
                 "values take these arguments, and values both give must agree",
    "ddp_backend": "detect(backend=...)",
    "ddp_timeout": "detect(timeout=...) in seconds (default 1800)",
    "ddp_find_unused_parameters": "replicate(find_unused_parameters=...); None: False",
    "ddp_bucket_cap_mb": "replicate(bucket_mb=...); None: 25",
    "ddp_broadcast_buffers": "replicate(broadcast_buffers=...); None: True",
    "ddp_static_graph": "replicate(static_graph=...); None: False",
    "use_cpu": "detect(device=\"cpu\")",
    "parallelism_config": "Accelerate's ParallelismConfig (or a dict of its fields): tp_size "
                          "-> tensor_parallel(size=...), dp_shard_size -> shard() over the "
                          "data ranks, dp_replicate_size -> HSDP across nodes (or replicate() "
                          "alone), cp_size or sp_size -> context_parallel(size=...) (Ulysses)",
    "torch_compile": "compile(regional=False): the whole model, as the Trainer compiles it",
    "torch_compile_backend": "compile(backend=...) (setting it implies torch_compile=True, as "
                             "in Transformers)",
    "torch_compile_mode": "compile(mode=...) (setting it implies torch_compile=True)",
    # precision and the step
    "bf16": "mixed_precision(\"bf16\"); with neither bf16 nor fp16: mixed_precision(\"fp32\")",
    "fp16": "mixed_precision(\"fp16\") (a GradScaler; needs a GPU)",
    "gradient_accumulation_steps": "accumulate_gradients(n) when n > 1",
    "max_grad_norm": "clip_gradients(max_norm) when > 0 (default 1.0, as the Trainer)",
    "activation_checkpointing": "checkpoint_activations() (of fsdp_config's blocks under FSDP)",
    "gradient_checkpointing": "the same as activation_checkpointing (its old name)",
    "gradient_checkpointing_kwargs": "a notice when set: torch's non-reentrant checkpoint is "
                                     "used",
    "activation_checkpointing_kwargs": "a notice when set: torch's non-reentrant checkpoint is "
                                       "used",
    "average_tokens_across_devices": "true (default): the loss is averaged over the items of "
                                     "all ranks, as bundle.step does when loss_fn returns "
                                     "(loss, num_items); false: refused",
    "accelerator_config": "a dict, a JSON path or an AcceleratorConfig: non_blocking -> "
                          "distribute_data(non_blocking=...); gradient_accumulation_kwargs."
                          "sync_with_dataloader -> accumulate_gradients(sync_with_dataloader="
                          "...), .num_steps must equal gradient_accumulation_steps, "
                          ".sync_each_batch -> shard(sync_each_batch=...); split_batches, "
                          "dispatch_batches and even_batches=false refused; "
                          "use_seedable_sampler=false and use_configured_state a notice",
    # data
    "per_device_train_batch_size": "checked against the loader's batch_size when the "
                                   "pipeline is called",
    "dataloader_pin_memory": "distribute_data(pin_memory=...): true pins where CUDA is the "
                             "device",
    "seed": "distribute_data(seed=...) unless data_seed is given",
    "data_seed": "distribute_data(seed=...)",
    # the loop: Pipeline.fit_options for sw.fit
    "num_train_epochs": "sw.fit(epochs=...): whole epochs (a fraction is refused: use "
                        "max_steps); ignored for max_steps > 0, as the Trainer",
    "max_steps": "sw.fit(steps=...) when > 0",
    "logging_strategy": "steps: sw.fit(log_every=logging_steps); no: log_every=None; epoch: "
                        "refused",
    "logging_steps": "sw.fit(log_every=...) (a fraction < 1 of max_steps when max_steps > 0)",
    "save_strategy": "steps: sw.fit(checkpoint_dir=output_dir, checkpoint_every=save_steps); "
                     "no: no checkpoints; epoch and best: refused",
    "save_steps": "sw.fit(checkpoint_every=...) (a fraction < 1 of max_steps when max_steps > "
                  "0)",
    "save_total_limit": "sw.fit(keep_last=...)",
    "output_dir": "sw.fit(checkpoint_dir=...) (default trainer_output); sw.fit resumes from "
                  "its newest checkpoint (the Trainer only when asked)",
    "eval_strategy": "steps: sw.fit(eval_every=eval_steps or logging_steps), with your "
                     "eval_fn; no: eval_every=None; epoch: refused",
    "eval_steps": "sw.fit(eval_every=...)",
    "resume_from_checkpoint": "a notice when set: sw.fit resumes from the newest checkpoint "
                              "in output_dir (for another one, sw.load it and pass state=)",
    "disable_tqdm": "sw.fit(progress=not disable_tqdm)",
    "report_to": "sw.fit(report_to=[...], config=<the arguments>), beside your own loggers=: "
                 "tensorboard (TensorBoardLogger(output_dir/runs)), wandb, mlflow, trackio "
                 "(WandbTracker, MLflowTracker, TrackioTracker), all (those installed), a name "
                 "register_tracker added; none: no loggers; other names refused",
}

#: fields with no meaning here: a notice when set to something other than their default
NOTICED: dict[str, str] = {
    **dict.fromkeys(["learning_rate", "optim", "optim_args", "weight_decay", "adam_beta1",
                     "adam_beta2", "adam_epsilon", "optim_target_modules"], _OPT),
    **dict.fromkeys(["lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps"], _SCHED),
    **dict.fromkeys(["dataloader_drop_last", "dataloader_num_workers",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataloader_multiprocessing_context", "dataloader_in_order",
                     "per_device_eval_batch_size", "remove_unused_columns", "label_names",
                     "train_sampling_strategy", "length_column_name"], _LOADER),
    **dict.fromkeys(["push_to_hub", "hub_token", "hub_private_repo", "hub_model_id",
                     "hub_strategy", "hub_always_push", "hub_revision"], _HUB),
    **dict.fromkeys(["prediction_loss_only", "eval_on_start", "eval_do_concat_batches",
                     "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
                     "batch_eval_metrics", "eval_delay", "load_best_model_at_end",
                     "metric_for_best_model", "greater_is_better"], _EVAL),
    **dict.fromkeys(["run_name", "project", "trackio_space_id", "trackio_bucket_id",
                     "trackio_static_space_id", "log_level", "log_level_replica",
                     "log_on_each_node", "logging_nan_inf_filter", "logging_first_step",
                     "include_num_input_tokens_seen", "skip_memory_metrics", "debug",
                     "do_train", "do_eval", "do_predict", "save_only_model",
                     "save_on_each_node", "enable_jit_checkpoint", "ignore_data_skip",
                     "restore_callback_states_from_checkpoint", "auto_find_batch_size",
                     "use_cache", "neftune_noise_alpha", "torch_empty_cache_steps",
                     "use_liger_kernel", "liger_kernel_config"], _TRAINER),
    "label_smoothing_factor": "is the Trainer's loss and is not applied (smooth in your "
                              "loss_fn)",
    "bf16_full_eval": "is not applied: bundle.predict evaluates at the training precision",
    "fp16_full_eval": "is not applied: bundle.predict evaluates at the training precision",
    "tf32": "is not applied: set torch.backends.cuda.matmul.allow_tf32 yourself",
    "full_determinism": "is not applied: call torch.use_deterministic_algorithms(True) "
                        "yourself",
    "local_rank": "is not applied: the launcher's LOCAL_RANK is read by sw.detect",
}
ARGUMENTS.update({name: f"a notice when set: {why.removeprefix('is ')}"
                  for name, why in NOTICED.items()})


def plain_value(value: Any) -> Any:
    """An enum's value (TrainingArguments keeps strategies as str enums)."""
    return getattr(value, "value", value)
