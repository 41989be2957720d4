# Accelerate's default_config.yaml mapped onto a pipeline.
"""``accelerate config`` YAML -> transforms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.configs._read import Source, load_source
from shardwise.configs.deepspeed import clipping, deepspeed_transforms, stage_transforms
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.accumulate_gradients import accumulate_gradients
from shardwise.transforms.base import Transform
from shardwise.transforms.clip_gradients import ClipGradients
from shardwise.transforms.mixed_precision import MixedPrecision, mixed_precision
from shardwise.transforms.replicate import replicate

LAUNCH = {"compute_environment", "num_processes", "num_machines", "machine_rank",
          "main_process_ip", "main_process_port", "rdzv_backend", "same_network", "gpu_ids",
          "use_cpu", "main_training_function", "debug", "enable_cpu_affinity"}
IGNORED = {"tpu_env": "is for TPUs", "tpu_use_cluster": "is for TPUs",
           "tpu_use_sudo": "is for TPUs", "dynamo_config": "is not applied (no compile yet)",
           "downcast_bf16": "is for TPUs: bf16 here keeps fp32 master weights",
           "ipex_config": "is not applied (Intel extension)",
           "mpirun_config": "is not applied (launch with mpirun yourself; sw.detect reads it)",
           "megatron_lm_config": "is not applied (Megatron-LM is not driven by shardwise)"}
TOP = {"distributed_type", "mixed_precision", "fsdp_config", "deepspeed_config",
       *LAUNCH, *IGNORED}
_DS_ONLY = ("zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher",
            "deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
            "deepspeed_moe_layer_cls_names")
DS_BLOCK = {"zero_stage", "offload_optimizer_device", "offload_param_device",
            "gradient_accumulation_steps", "gradient_clipping", "deepspeed_config_file",
            *_DS_ONLY}


def _deepspeed_block(src: Source, block: dict[str, Any], env: Env) -> list[Transform]:
    src.check_keys(block, DS_BLOCK, " in deepspeed_config")
    for key in _DS_ONLY:
        if key in block:
            src.notice(f"deepspeed_config.{key}", "has no meaning outside DeepSpeed")
    if "deepspeed_config_file" in block:
        path = Path(str(block["deepspeed_config_file"]))
        if not path.is_absolute() and src.base is not None:
            path = src.base / path
        try:
            inner = load_source(path)
        except ConfigError as exc:
            raise ConfigError(f"{src.origin}: deepspeed_config.deepspeed_config_file: {exc}") \
                from None
        out, steps = deepspeed_transforms(inner, env)
        src.notices += inner.notices
        clip = next((t.max_norm for t in out if isinstance(t, ClipGradients)), None)
        mine_clip = block.get("gradient_clipping")
        if isinstance(mine_clip, (int, float)) and mine_clip > 0 and mine_clip != clip:
            raise ConfigError(
                f"{src.origin}: deepspeed_config.gradient_clipping={mine_clip} contradicts "
                f"gradient_clipping={clip} in {path}; set it once")
        if "gradient_accumulation_steps" in block and steps is not None:
            mine = src.integer("deepspeed_config.gradient_accumulation_steps",
                               block["gradient_accumulation_steps"], 1)
            if mine != steps:
                raise ConfigError(
                    f"{src.origin}: deepspeed_config.gradient_accumulation_steps={mine} "
                    f"contradicts gradient_accumulation_steps={steps} in {path}; set it once")
        return out
    stage = src.integer("deepspeed_config.zero_stage", block.get("zero_stage", 0))
    out = stage_transforms(src, stage, [
        ("deepspeed_config.offload_optimizer_device", block.get("offload_optimizer_device")),
        ("deepspeed_config.offload_param_device", block.get("offload_param_device"))])
    steps = src.integer("deepspeed_config.gradient_accumulation_steps",
                        block.get("gradient_accumulation_steps", 1), 1)
    if steps > 1:
        out.append(accumulate_gradients(steps))
    return out + clipping(src, "deepspeed_config.gradient_clipping", block.get("gradient_clipping"))


def accelerate_transforms(src: Source, env: Env) -> list[Transform]:
    """Transforms for an Accelerate config mapping."""
    cfg = src.data
    src.check_keys(cfg, TOP)
    for key, why in IGNORED.items():
        if key in cfg:
            src.notice(key, why)
    kind = src.choice("distributed_type", cfg.get("distributed_type", "NO"),
                      ["NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"])
    out: list[Transform] = []
    if kind in ("MULTI_CPU", "MULTI_GPU"):
        out.append(replicate())
    elif kind == "FSDP":
        out += fsdp_transforms(src, dict(cfg.get("fsdp_config") or {}))
    elif kind == "DEEPSPEED":
        out += _deepspeed_block(src, dict(cfg.get("deepspeed_config") or {}), env)
    precision = cfg.get("mixed_precision") or "no"
    if str(precision).lower() == "fp8":
        raise src.fail("mixed_precision", precision, "no, fp16, bf16 (fp8 is not supported)")
    precision = src.choice("mixed_precision", str(precision).upper(), ["NO", "FP16", "BF16"])
    given = next((t for t in out if isinstance(t, MixedPrecision)), None)
    if given is not None and precision != "NO" and given.precision != precision.lower():
        raise ConfigError(f"{src.origin}: mixed_precision={precision.lower()!r} contradicts "
                          f"{given.precision!r} enabled in the DeepSpeed config; set it once")
    if precision != "NO" and given is None:
        out.append(mixed_precision(precision.lower()))
    return out
