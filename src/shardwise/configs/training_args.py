# Transformers' TrainingArguments (or a mapping of the same names) mapped onto transforms and sw.fit settings.
"""``TrainingArguments`` -> env overrides, transforms, ``sw.fit`` settings and notices.

Every field of ``TrainingArguments`` is in :data:`ARGUMENTS` with what it becomes here: a
transform, an env setting, a ``sw.fit`` setting, a notice (no meaning here) or a refusal.
Values a mapping leaves out take ``TrainingArguments``' defaults (:data:`DEFAULTS`), so a
mapping and the ``TrainingArguments`` built from it mean the same pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shardwise._config_source import Source, load_source, short
from shardwise.configs import ddp_settings
from shardwise.configs.deepspeed import BatchCheck, Said, build, merge, read_json
from shardwise.configs.dynamo import compile_of
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.configs.parallelism import SIZES, asks_for_mesh, parallelism_transforms
from shardwise.env import Env, detect
from shardwise.errors import ConfigError
from shardwise.transforms.accumulate_gradients import accumulate_gradients
from shardwise.transforms.base import Transform
from shardwise.transforms.checkpoint_activations import CheckpointActivations, checkpoint_activations
from shardwise.transforms.clip_gradients import clip_gradients
from shardwise.transforms.distribute_data import distribute_data
from shardwise.transforms.mixed_precision import MixedPrecision, mixed_precision
from shardwise.transforms.replicate import replicate
from shardwise.transforms.shard import Shard

__all__ = ["ARGUMENTS", "DEFAULTS", "TrainingSettings", "read_training_args"]

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
                          "alone); cp_size/sp_size > 1 refused",
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
    "report_to": "tensorboard: sw.fit(loggers=[TensorBoardLogger(output_dir/runs)]); none: "
                 "no loggers; other integrations refused",
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

_ACCELERATOR_KEYS = {"split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                     "non_blocking", "gradient_accumulation_kwargs", "use_configured_state"}
_FSDP_OPTIONS = {"full_shard": ("reshard_after_forward", True),
                 "shard_grad_op": ("reshard_after_forward", False),
                 "hybrid_shard": ("sharding_strategy", "HYBRID_SHARD"),
                 "hybrid_shard_zero2": ("sharding_strategy", "HYBRID_SHARD_ZERO2"),
                 "no_shard": ("sharding_strategy", "NO_SHARD"),
                 "offload": ("cpu_offload", True), "auto_wrap": None}
#: what TrainingArguments writes into fsdp_config itself: asks for nothing
_FILLED = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}


def per_device_batch(size: int, origin: str = "TrainingArguments") -> BatchCheck:
    """``per_device_train_batch_size`` checked against the loader's ``batch_size`` when the
    pipeline is called: the Trainer would have used the argument."""
    return BatchCheck(origin, size, micro_key="per_device_train_batch_size")


@attrs.frozen
class TrainingSettings:
    """What a ``TrainingArguments`` means: env overrides, transforms, ``sw.fit`` options."""

    overrides: dict[str, Any]
    transforms: tuple[Transform, ...]
    fit_options: dict[str, Any]
    notices: tuple[str, ...]
    origin: str


def _plain(value: Any) -> Any:
    """An enum's value (TrainingArguments keeps strategies as str enums)."""
    return getattr(value, "value", value)


def _fields(args: Any) -> tuple[dict[str, Any], str, bool]:
    """(the arguments by name, the origin, whether it is a TrainingArguments)."""
    if isinstance(args, Mapping):
        data = dict(args)
        unknown = sorted(k for k in data if k not in ARGUMENTS)
        if unknown:
            shown = ", ".join(short(k) for k in unknown[:5])
            raise ConfigError(f"training arguments: unknown argument(s) [{shown}]; accepted: "
                              "the fields of transformers.TrainingArguments (see "
                              "docs/training-args.md)")
        return {**DEFAULTS, **data}, "training arguments <mapping>", False
    if dataclasses.is_dataclass(args) and not isinstance(args, type) and \
            type(args).__name__ == "TrainingArguments":
        data = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return data, "TrainingArguments", True
    raise ConfigError(f"from_training_args() takes a transformers.TrainingArguments or a mapping "
                      f"of its field names (got {type(args).__name__}: {short(args)})")


def _defaults_of(args: Any) -> dict[str, Any]:
    """Each field's default, for the fields a notice is given for when set."""
    out = {}
    for field in dataclasses.fields(args):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out


def _is_set(value: Any, default: Any) -> bool:
    """Whether a value asks for something (not its default, not empty)."""
    value = _plain(value)
    if value is None or value is False or (isinstance(value, (str, list, tuple, dict))
                                           and not value):
        return False
    return not (type(value) is type(default) and value == default)


def _fraction_or_count(src: Source, key: str, value: Any, max_steps: int) -> int:
    """A step interval: an integer >= 1, or a fraction < 1 of ``max_steps``."""
    if isinstance(value, float) and 0 < value < 1:
        if max_steps <= 0:
            raise src.fail(key, value, "an integer >= 1 (a fraction needs max_steps > 0)")
        return max(1, math.ceil(value * max_steps))
    return src.integer(key, value, 1)


def _strategy(src: Source, key: str, value: Any, accepted: tuple[str, ...]) -> str:
    text = _plain(value)
    if not isinstance(text, str) or text.lower() not in accepted:
        why = " (sw.fit counts optimizer steps)" if text in ("epoch", "best") else ""
        raise src.fail(key, value, ", ".join(accepted) + why)
    return text.lower()


def _loop(src: Source, a: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``sw.fit`` options, and notes for explain()."""
    fit: dict[str, Any] = {}
    notes: list[str] = []
    max_steps = src.integer("max_steps", a["max_steps"], -1)
    if max_steps > 0:
        fit["steps"] = max_steps
    else:
        epochs = src.number("num_train_epochs", a["num_train_epochs"])
        if not float(epochs).is_integer() or epochs < 1:
            raise src.fail("num_train_epochs", a["num_train_epochs"], "a whole number of epochs "
                           ">= 1 (for part of an epoch, set max_steps)")
        fit["epochs"] = int(epochs)
    logging = _strategy(src, "logging_strategy", a["logging_strategy"], ("steps", "no"))
    fit["log_every"] = None if logging == "no" else _fraction_or_count(
        src, "logging_steps", a["logging_steps"], max_steps)
    saving = _strategy(src, "save_strategy", a["save_strategy"], ("steps", "no"))
    output = src.text("output_dir", "trainer_output" if a["output_dir"] is None
                      else str(a["output_dir"]))
    if saving == "steps":
        fit["checkpoint_dir"] = output
        fit["checkpoint_every"] = _fraction_or_count(src, "save_steps", a["save_steps"],
                                                     max_steps)
        if a["save_total_limit"] is not None:
            fit["keep_last"] = src.integer("save_total_limit", a["save_total_limit"], 1)
        notes.append(f"output_dir: sw.fit resumes from the newest checkpoint in {output} "
                     "(the Trainer resumes only when asked)")
    elif a["save_total_limit"] is not None:
        src.notice("save_total_limit", "is not applied: save_strategy is no")
    evaluating = _strategy(src, "eval_strategy", a["eval_strategy"], ("steps", "no"))
    if evaluating == "steps":
        every = a["eval_steps"] if a["eval_steps"] is not None else a["logging_steps"]
        fit["eval_every"] = _fraction_or_count(src, "eval_steps", every, max_steps)
    if a["resume_from_checkpoint"] is not None:
        src.check_shape("resume_from_checkpoint", str(a["resume_from_checkpoint"]), "text")
        src.notice("resume_from_checkpoint", f"is not applied: sw.fit resumes from the newest "
                   f"checkpoint in {output}; for another one, sw.load it and pass state=")
    fit["progress"] = not (a["disable_tqdm"] is not None
                           and src.boolean("disable_tqdm", a["disable_tqdm"]))
    fit["loggers"] = _loggers(src, a["report_to"], output)
    return fit, notes


def _loggers(src: Source, value: Any, output: str) -> list[Any]:
    from shardwise.loggers import TensorBoardLogger

    names = [value] if isinstance(value, str) else value
    if names is None:
        return []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise src.fail("report_to", value, "tensorboard, none, or a list of those")
    out = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger(str(Path(output) / "runs")))
        elif name != "none":
            raise src.fail("report_to", value, "tensorboard or none (other integrations: pass "
                           "your own logger to sw.fit(loggers=...))")
    return out


def _load(src: Source, key: str, value: Any) -> Source:
    """The JSON or YAML file (or mapping) an argument gives, its refusal naming the argument."""
    try:
        return load_source(value)
    except ConfigError as exc:
        raise ConfigError(f"{src.origin}: {key}: {exc}") from None


def _accelerator(src: Source, value: Any) -> dict[str, Any]:
    """``accelerator_config`` as a checked dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, (str, Path)):
        value = _load(src, "accelerator_config", value).data
    cfg = src.mapping("accelerator_config", value)
    src.check_keys(cfg, _ACCELERATOR_KEYS, "accelerator_config")
    for key, refused in (("split_batches", True), ("dispatch_batches", True),
                         ("even_batches", False)):
        if cfg.get(key) is not None and src.boolean(f"accelerator_config.{key}", cfg[key]) \
                is refused:
            why = {"split_batches": "each rank takes the loader's batch_size (build the loader "
                                    "with the per-device batch size)",
                   "dispatch_batches": "every rank reads its own share of the data",
                   "even_batches": "the sampler pads every rank to the same number of batches "
                                   "(sw.gather_for_metrics drops the padding)"}[key]
            raise src.fail(f"accelerator_config.{key}", cfg[key], f"{not refused}: {why}")
    for key, why in (("use_seedable_sampler", "false: the sampler is always seeded "
                                              "(distribute_data(seed=...))"),
                     ("use_configured_state", "true: the pipeline builds its own state")):
        if cfg.get(key) is not None and src.boolean(f"accelerator_config.{key}", cfg[key]) \
                is (key == "use_configured_state"):
            src.notice(f"accelerator_config.{key}", f"is not applied: {why}")
    return cfg


def _accumulation(src: Source, a: dict[str, Any], cfg: dict[str, Any]) -> tuple[
        int, bool, bool]:
    """(steps, sync_with_dataloader, sync_each_batch)."""
    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    kwargs = src.mapping("accelerator_config.gradient_accumulation_kwargs",
                         cfg.get("gradient_accumulation_kwargs"))
    where = "accelerator_config.gradient_accumulation_kwargs"
    src.check_keys(kwargs, {"num_steps", "sync_with_dataloader", "sync_each_batch",
                            "adjust_scheduler"}, where)
    if kwargs.get("num_steps") is not None:
        given = src.integer(f"{where}.num_steps", kwargs["num_steps"], 1)
        if given != steps:
            raise ConfigError(f"{src.origin}: {where}.num_steps={given} contradicts "
                              f"gradient_accumulation_steps={steps}; set one")
    if kwargs.get("adjust_scheduler") is not None and \
            not src.boolean(f"{where}.adjust_scheduler", kwargs["adjust_scheduler"]):
        src.notice(f"{where}.adjust_scheduler", "is not applied: the scheduler steps once "
                   "per optimizer step")
    sync = src.boolean(f"{where}.sync_with_dataloader", kwargs.get("sync_with_dataloader", True))
    each = src.boolean(f"{where}.sync_each_batch", kwargs.get("sync_each_batch", False))
    return steps, sync, each


def _fsdp_block(src: Source, a: dict[str, Any]) -> dict[str, Any] | None:
    """The FSDP settings of ``fsdp`` + ``fsdp_config``, None without FSDP."""
    value = _plain(a["fsdp"])
    options: list[str] = []
    if isinstance(value, str):
        options = value.split()
    elif isinstance(value, (list, tuple)):
        options = [str(_plain(v)) for v in value]
    elif value not in (None, False, True):
        raise src.fail("fsdp", value, "true, or options like \"full_shard auto_wrap\"")
    if not (value is True or options):
        if a["fsdp_config"]:
            src.notice("fsdp_config", "is not applied: fsdp is not set")
        return None
    raw = a["fsdp_config"]
    block = dict(_load(src, "fsdp_config", raw).data) if isinstance(raw, (str, Path)) else \
        src.mapping("fsdp_config", raw)
    block = {k.removeprefix("fsdp_"): v for k, v in block.items()}
    for key, filled in _FILLED.items():  # what TrainingArguments writes itself
        if key in block and type(block[key]) is type(filled) and block[key] == filled:
            del block[key]
    for option in options:
        if option not in _FSDP_OPTIONS:
            raise src.fail("fsdp", value, ", ".join(_FSDP_OPTIONS))
        if _FSDP_OPTIONS[option] is not None:
            key, setting = _FSDP_OPTIONS[option]  # type: ignore[misc]
            block.setdefault(key, setting)
    return block


def _deepspeed(src: Source, a: dict[str, Any], env: Env) -> list[Transform]:
    """The DeepSpeed config, its ``"auto"`` values taken from the arguments; a value both
    give must agree (as the Trainer refuses mismatches)."""
    raw = a["deepspeed"]
    inner = _load(src, "deepspeed", raw if isinstance(raw, (str, Path, Mapping)) else
                  src.mapping("deepspeed", raw))
    try:
        theirs = read_json(inner)
    except ConfigError as exc:
        raise ConfigError(f"{src.origin}: deepspeed: {exc}") from None
    src.notices += inner.notices

    def mine(key: str, value: Any) -> Said:
        return Said(key, value, value, src.origin)

    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    clip = src.number("max_grad_norm", a["max_grad_norm"])
    settings = {"steps": mine("gradient_accumulation_steps", steps),
                "clipping": mine("max_grad_norm", clip),
                "fp16": mine("fp16", src.boolean("fp16", a["fp16"])),
                "bf16": mine("bf16", src.boolean("bf16", a["bf16"])),
                "micro": mine("per_device_train_batch_size", src.integer(
                    "per_device_train_batch_size", a["per_device_train_batch_size"], 1))}
    out = build(src, merge(settings, theirs), env)
    if not any(isinstance(t, MixedPrecision) for t in out):  # the Trainer's default: fp32
        out.append(mixed_precision("fp32"))
    return out


def read_training_args(args: Any, env: Env | None = None,
                       engine: str = "native") -> TrainingSettings:
    """What a ``TrainingArguments`` (or a mapping of its field names) means here.

    Raises:
        ConfigError: an unknown name, a value of the wrong type or range, a setting with no
            counterpart that changes results, or a contradiction, naming the argument(s).
    """
    a, origin, instance = _fields(args)
    src = Source({}, origin)
    defaults = _defaults_of(args) if instance else {}
    for name, why in NOTICED.items():
        if name in a and _is_set(a[name], defaults.get(name)):
            src.notice(name, why)
    mesh = _mesh_block(src, a.get("parallelism_config"))
    if not src.boolean("average_tokens_across_devices", a["average_tokens_across_devices"]):
        raise src.fail("average_tokens_across_devices", False, "true (the loss is averaged over "
                       "the items of all ranks)")
    overrides, replicated = _ddp(src, a)
    if src.boolean("use_cpu", a["use_cpu"]):
        overrides["device"] = "cpu"
    if env is None:
        env = detect(**overrides)
    elif overrides:
        env = attrs.evolve(env, **overrides)
    accel = _accelerator(src, a["accelerator_config"])
    steps, sync, each = _accumulation(src, a, accel)
    fsdp = _fsdp_block(src, a)
    if engine == "deepspeed" and a["deepspeed"] is None:
        raise ConfigError(f"{origin}: engine=\"deepspeed\" runs the DeepSpeed config of the "
                          "deepspeed argument, which is not set")
    if a["deepspeed"] is not None:
        if fsdp is not None:
            raise ConfigError(f"{origin}: fsdp and deepspeed are both set; choose one")
        if mesh and asks_for_mesh(src, mesh, "parallelism_config."):
            raise src.fail("parallelism_config", a["parallelism_config"], "None beside "
                           "deepspeed (its ZeRO stages are the data-parallel dimension)")
        out = _deepspeed_engine(src, a) if engine == "deepspeed" else _deepspeed(src, a, env)
        if each or not sync:
            src.notice("accelerator_config.gradient_accumulation_kwargs", "is not applied "
                       "under deepspeed (its accumulation follows gradient_accumulation_steps)")
    else:
        out = _distribution(src, fsdp, replicated, each)
        if mesh:
            out = parallelism_transforms(src, mesh, out, env, where="parallelism_config.")
        out += _precision(src, a)
        if steps > 1:
            out.append(src.build("gradient_accumulation_steps", steps, accumulate_gradients,
                                 steps, sync_with_dataloader=sync))
        clip = src.number("max_grad_norm", a["max_grad_norm"])
        if clip > 0:
            out.append(src.build("max_grad_norm", clip, clip_gradients, clip))
        out.append(per_device_batch(src.integer("per_device_train_batch_size",
                                                a["per_device_train_batch_size"], 1), origin))
    out += _compiled(src, a)
    if _checkpointing(src, a) and not any(isinstance(t, CheckpointActivations) for t in out):
        policy = next((t.policy for t in out if isinstance(t, Shard)), None)
        out.append(checkpoint_activations(policy))
    out.append(_data(src, a, accel))
    fit, notes = _loop(src, a)
    return TrainingSettings(overrides, tuple(out), fit, (*src.notices, *notes), origin)


def _compiled(src: Source, a: dict[str, Any]) -> list[Transform]:
    """``torch_compile`` (or a backend or mode, which imply it): the whole model compiled."""
    backend, mode = a.get("torch_compile_backend"), a.get("torch_compile_mode")
    if not (src.boolean("torch_compile", a.get("torch_compile", False)) or backend or mode):
        return []
    return [compile_of(src, backend or "inductor", mode, where="torch_compile_")]


def _mesh_block(src: Source, value: Any) -> dict[str, Any]:
    """TrainingArguments' ``parallelism_config``: an Accelerate ``ParallelismConfig`` (its
    fields read) or a dict of its field names; empty when None."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    fields = [name for name in (*SIZES, "cp_backend", "sp_backend") if hasattr(value, name)]
    if not fields:
        raise src.fail("parallelism_config", value, "an accelerate ParallelismConfig, a dict "
                       "of its fields (dp_replicate_size, dp_shard_size, tp_size, cp_size), "
                       "or None")
    return {name: getattr(value, name) for name in fields}


def _deepspeed_engine(src: Source, a: dict[str, Any]) -> list[Transform]:
    """DeepSpeed's own engine on the ``deepspeed`` config. As the Trainer does, a value the
    config gives must equal the argument's, and ``"auto"`` takes the argument's (clipping
    only where the config says ``"auto"``: DeepSpeed does not clip by default)."""
    from shardwise._deepspeed_auto import AUTO
    from shardwise.configs.deepspeed_json import engine_config
    from shardwise.transforms.deepspeed import deepspeed

    raw = a["deepspeed"]
    try:
        config = engine_config(raw, "deepspeed")
    except ConfigError as exc:
        raise ConfigError(f"{src.origin}: deepspeed: {exc}") from None
    where = str(raw) if isinstance(raw, (str, Path)) else "the deepspeed mapping"
    steps = src.integer("gradient_accumulation_steps", a["gradient_accumulation_steps"], 1)
    clip = src.number("max_grad_norm", a["max_grad_norm"])
    bf16, fp16 = src.boolean("bf16", a["bf16"]), src.boolean("fp16", a["fp16"])
    per_device = src.integer("per_device_train_batch_size", a["per_device_train_batch_size"], 1)

    def said(*path: str) -> Any:
        value: Any = config
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    for path, argument, value in ((("gradient_accumulation_steps",), "gradient_accumulation_steps",
                                   steps),
                                  (("gradient_clipping",), "max_grad_norm", clip),
                                  (("train_micro_batch_size_per_gpu",),
                                   "per_device_train_batch_size", per_device),
                                  (("bf16", "enabled"), "bf16", bf16),
                                  (("fp16", "enabled"), "fp16", fp16)):
        given = said(*path)
        if given is not None and given != AUTO and given != value:
            raise ConfigError(f"{src.origin}: {argument}={short(value)} contradicts "
                              f"{'.'.join(path)}={short(given)} in {where}; set one (or "
                              "\"auto\" in the file)")
    if bf16 and fp16:
        raise ConfigError(f"{src.origin}: bf16=True and fp16=True; choose one")
    out: list[Transform] = [
        deepspeed(config, source=where),
        mixed_precision("bf16" if bf16 else "fp16" if fp16 else "fp32")]
    if steps > 1:
        out.append(accumulate_gradients(steps))
    if said("gradient_clipping") == AUTO and clip > 0:
        out.append(clip_gradients(clip))
    return [*out, per_device_batch(per_device, src.origin)]


def _ddp(src: Source, a: dict[str, Any]) -> tuple[dict[str, Any], Transform]:
    try:
        overrides, replicated = ddp_settings(
            ddp_backend=a["ddp_backend"], ddp_find_unused_parameters=a["ddp_find_unused_parameters"],
            ddp_bucket_cap_mb=a["ddp_bucket_cap_mb"], ddp_timeout=a["ddp_timeout"],
            ddp_broadcast_buffers=a["ddp_broadcast_buffers"])
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("from_ddp_args()", src.origin)) from None
    if a["ddp_static_graph"] is not None:
        static = src.boolean("ddp_static_graph", a["ddp_static_graph"])
        replicated = attrs.evolve(replicated, static_graph=static)  # type: ignore[misc]
    return overrides, replicated


def _distribution(src: Source, fsdp: dict[str, Any] | None, replicated: Transform,
                  each: bool) -> list[Transform]:
    if fsdp is None:
        if each:
            src.notice("accelerator_config.gradient_accumulation_kwargs.sync_each_batch",
                       "has no effect on results with DDP and is not applied")
        return [replicated]
    if replicated != replicate():
        src.notice("ddp_*", "are not applied: fsdp is set (DDP options have no meaning there)")
    out = fsdp_transforms(src, fsdp, "fsdp_config.")
    if each:
        out = [attrs.evolve(t, sync_each_batch=True) if isinstance(t, Shard) else t
               for t in out]
    return out


def _precision(src: Source, a: dict[str, Any]) -> list[Transform]:
    bf16, fp16 = src.boolean("bf16", a["bf16"]), src.boolean("fp16", a["fp16"])
    if bf16 and fp16:
        raise ConfigError(f"{src.origin}: bf16=True and fp16=True; choose one")
    return [mixed_precision("bf16" if bf16 else "fp16" if fp16 else "fp32")]


def _checkpointing(src: Source, a: dict[str, Any]) -> bool:
    on = [src.boolean(k, a[k]) for k in ("activation_checkpointing", "gradient_checkpointing")
          if a.get(k) is not None]
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if a.get(key):
            src.notice(key, "is not applied: torch's non-reentrant checkpoint is used")
    return any(on)


def _data(src: Source, a: dict[str, Any], accel: dict[str, Any]) -> Transform:
    seed = a["data_seed"] if a["data_seed"] is not None else a["seed"]
    key = "data_seed" if a["data_seed"] is not None else "seed"
    # TrainingArguments turns pinning off for use_cpu itself
    pin = src.boolean("dataloader_pin_memory", a["dataloader_pin_memory"]) and \
        not src.boolean("use_cpu", a["use_cpu"])
    non_blocking = src.boolean("accelerator_config.non_blocking",
                               accel.get("non_blocking", False))
    return src.build(key, seed, distribute_data, seed=src.integer(key, seed, 0, 2**64 - 1),
                     pin_memory=None if pin else False, non_blocking=non_blocking)


def markdown_table() -> str:
    """The table of docs/training-args.md: every argument and what it becomes."""
    rows = [f"| `{name}` | {meaning} |" for name, meaning in ARGUMENTS.items()]
    return "\n".join(["| argument | what it becomes here |", "|---|---|", *rows])

