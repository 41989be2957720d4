# DeepSpeed settings (ds_config.json, or Accelerate's deepspeed_config block) mapped onto native transforms.
"""ZeRO stages -> replicate / shard_optimizer / shard; offload; precision; accumulation."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from shardwise.bundle import Bundle
from shardwise.configs._read import Source
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.accumulate_gradients import accumulate_gradients
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.clip_gradients import clip_gradients
from shardwise.transforms.mixed_precision import mixed_precision
from shardwise.transforms.offload import offload
from shardwise.transforms.replicate import replicate
from shardwise.transforms.shard import shard
from shardwise.transforms.shard_optimizer import shard_optimizer

TOP = {"zero_optimization", "fp16", "bf16", "gradient_accumulation_steps", "gradient_clipping",
       "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler",
       "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
       "zero_force_ds_cpu_optimizer", "communication_data_type", "prescale_gradients"}
_TUNING = {"allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
           "reduce_bucket_size", "contiguous_gradients", "round_robin_gradients",
           "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
           "stage3_max_live_parameters", "stage3_max_reuse_distance",
           "stage3_gather_16bit_weights_on_model_save", "load_from_fp32_weights",
           "elastic_checkpoint", "ignore_unused_parameters"}


def stage_transforms(src: Source, stage: int, offload_devices: list[tuple[str, Any]]) -> list[Transform]:
    """ZeRO stage and offload devices -> transforms."""
    if stage not in (0, 1, 2, 3):
        raise src.fail("zero_optimization.stage", stage, "0, 1, 2 or 3")
    stages: list[list[Transform]] = [[replicate()], [replicate(), shard_optimizer()],
                                     [shard(reshard_after_forward=False)], [shard()]]
    out = stages[stage]
    devices = {key: str(device).lower() for key, device in offload_devices if device is not None}
    for key, device in devices.items():
        if device not in ("none", "cpu"):
            raise src.fail(key, device, "none or cpu (nvme offload is not supported)")
    if any(d == "cpu" for d in devices.values()):
        if stage < 2:
            raise src.fail(next(k for k, d in devices.items() if d == "cpu"), "cpu",
                           "offload with ZeRO stage 2 or 3 (shard), not with stage "
                           f"{stage}")
        out.append(offload())
    return out


def _auto(src: Source, key: str, value: Any) -> bool:
    if value == "auto":
        src.notice(key, "is 'auto': left to the pipeline's default")
        return True
    return False


def clipping(src: Source, key: str, value: Any) -> list[Transform]:
    """DeepSpeed's ``gradient_clipping`` (0 turns it off) as transforms."""
    if value is None or _auto(src, key, value):
        return []
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise src.fail(key, value, "a number >= 0")
    return [clip_gradients(float(value))] if value > 0 else []


def check_total(origin: str, total: int | None, micro: int | None, steps: int, world: int,
                micro_name: str) -> None:
    """DeepSpeed's rule: train batch = micro batch x accumulation steps x world size."""
    if total is not None and micro is not None and total != micro * steps * world:
        raise ConfigError(
            f"{origin}: train_batch_size={total} must equal {micro_name} ({micro}) x "
            f"gradient_accumulation_steps ({steps}) x world size ({world}) = "
            f"{micro * steps * world}")


def deepspeed_transforms(src: Source, env: Env) -> tuple[list[Transform], int | None]:
    """Transforms for a DeepSpeed JSON config, and its accumulation steps (None if unset)."""
    cfg = src.data
    src.check_keys(cfg, TOP)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            src.notice(key, "is not applied: the optimizer and scheduler you pass are used")
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "communication_data_type", "prescale_gradients"):
        if key in cfg:
            src.notice(key, "has no meaning outside DeepSpeed's engine")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise src.fail("zero_optimization", zero, "a mapping")
    src.check_keys(zero, {"stage", "offload_optimizer", "offload_param", *_TUNING},
                   " in zero_optimization")
    for key in sorted(set(zero) & _TUNING):
        src.notice(f"zero_optimization.{key}", "is DeepSpeed tuning with no FSDP2 counterpart")
    devices = [(f"zero_optimization.{k}.device", (zero.get(k) or {}).get("device"))
               for k in ("offload_optimizer", "offload_param")]
    out = stage_transforms(src, src.integer("zero_optimization.stage", zero.get("stage", 0)),
                           devices)
    enabled = {p: src.boolean(f"{p}.enabled", (cfg.get(p) or {}).get("enabled", False))
               for p in ("fp16", "bf16") if not _auto(src, f"{p}.enabled",
                                                     (cfg.get(p) or {}).get("enabled"))}
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ConfigError(f"{src.origin}: fp16.enabled and bf16.enabled are both true; "
                          "enable one")
    for precision in ("fp16", "bf16"):
        if enabled.get(precision):
            out.append(mixed_precision(precision))
    steps = None
    value = cfg.get("gradient_accumulation_steps")
    if value is not None and not _auto(src, "gradient_accumulation_steps", value):
        steps = src.integer("gradient_accumulation_steps", value, 1)
        if steps > 1:
            out.append(accumulate_gradients(steps))
    out += clipping(src, "gradient_clipping", cfg.get("gradient_clipping"))
    check = _check_batch(src, cfg, steps or 1, env)
    if check is not None:
        out.append(check)
    return out, steps


@attrs.frozen(repr=False)
class BatchCheck(Transform):
    """DeepSpeed's batch sizes against the bundle's loader, when the pipeline is called:
    ``"auto"`` sizes are taken from the loader, given ones must match it."""

    origin: str
    micro: int | None
    total: int | None
    steps: int
    stage: ClassVar[Stage] = Stage.DATA
    factory_name: ClassVar[str] = "deepspeed_batch_check"

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        size = getattr(bundle.loader, "batch_size", None)
        micro = self.micro if self.micro is not None else size
        if self.micro is not None and size is not None and size != self.micro:
            raise ConfigError(f"{self.origin}: train_micro_batch_size_per_gpu={self.micro} but "
                              f"the loader's batch_size is {size}; make them equal or set "
                              "it to \"auto\"")
        check_total(self.origin, self.total, micro, self.steps, bundle.env.world_size,
                    "the micro batch")
        return bundle

    def describe(self, env: Env) -> str:
        micro = self.micro if self.micro is not None else "the loader's batch_size"
        return (f"DeepSpeed batch sizes checked against the loader: micro {micro}, "
                f"accumulation {self.steps}, total {self.total or 'auto'}")


def _check_batch(src: Source, cfg: dict[str, Any], steps: int, env: Env) -> BatchCheck | None:
    total, micro = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
    if total is None and micro is None:
        return None
    total = None if total in (None, "auto") else src.integer("train_batch_size", total, 1)
    micro = None if micro in (None, "auto") else src.integer(
        "train_micro_batch_size_per_gpu", micro, 1)
    check_total(src.origin, total, micro, steps, env.world_size, "train_micro_batch_size_per_gpu")
    return BatchCheck(src.origin, micro, total, steps)
