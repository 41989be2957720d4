# Accelerate's default_config.yaml mapped onto a pipeline.
"""``accelerate config`` YAML -> transforms."""

from __future__ import annotations

import re
from typing import Any

from shardwise._config_source import Shape, Source
from shardwise.configs.deepspeed import build
from shardwise.configs.dynamo import dynamo_transforms
from shardwise.configs.fsdp import fsdp_transforms
from shardwise.configs.parallelism import asks_for_mesh, parallelism_transforms
from shardwise.deepspeed_engine.settings import read_block
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.base import Transform
from shardwise.transforms.precision_policy import mixed_precision
from shardwise.transforms.replication import replicate

LAUNCH = {"compute_environment", "num_processes", "num_machines", "machine_rank",
          "main_process_ip", "main_process_port", "rdzv_backend", "same_network", "gpu_ids",
          "use_cpu", "main_training_function", "debug", "enable_cpu_affinity"}
_TPU = "is for TPUs"
#: keys with no meaning here: the shape each takes (None: any) and why it gives a notice
IGNORED: dict[str, tuple[Shape | None, str]] = {
    "tpu_env": (None, _TPU), "tpu_use_cluster": (None, _TPU), "tpu_use_sudo": (None, _TPU),
    "commands": (None, _TPU), "command_file": (None, _TPU),
    "downcast_bf16": (None, "is for TPUs: bf16 here keeps fp32 master weights"),
    "ipex_config": ("mapping", "is not applied (Intel extension)"),
    "mpirun_config": ("mapping", "is not applied (launch with mpirun yourself; sw.detect reads "
                                 "it)"),
    "megatron_lm_config": ("mapping", "is not applied (Megatron-LM is not driven by shardwise)"),
    "fp8_config": ("mapping", "is not applied (fp8 is not supported)")}
TOP = {"distributed_type", "mixed_precision", "fsdp_config", "deepspeed_config",
       "parallelism_config", "dynamo_config", *LAUNCH, *IGNORED}
_KINDS = ["NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"]


def _gpu_ids(src: Source, value: Any) -> None:
    """``gpu_ids``: ``all``, a device number, or device numbers separated by commas."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**16:
        return
    if not (isinstance(value, str) and len(value) < 1000 and (
            value == "all" or re.fullmatch(r"\s*[0-9]+\s*(,\s*[0-9]+\s*)*", value))):
        raise src.fail("gpu_ids", value, "all, or device numbers like 0,1")


def _launch(src: Source, cfg: dict[str, Any]) -> None:
    """Check the launch settings (``shardwise launch`` reads them); those it does not apply
    give a notice when they ask for something."""
    def get(key: str, default: Any = None) -> Any:
        return default if cfg.get(key) is None else cfg[key]

    src.choice("compute_environment", get("compute_environment", "LOCAL_MACHINE"),
               ["LOCAL_MACHINE"])
    processes = src.integer("num_processes", get("num_processes", 1), 1)
    machines = src.integer("num_machines", get("num_machines", 1), 1)
    if processes % machines:
        raise ConfigError.at(src.origin, f"{src.key('num_processes')}={processes} must be a "
                             f"positive multiple of {src.key('num_machines')}={machines} "
                             "(processes are spread evenly)")
    src.integer("machine_rank", get("machine_rank", 0), 0, machines - 1)
    src.integer("main_process_port", get("main_process_port", 0), 0, 65535)
    if get("main_process_ip") is not None:
        src.text("main_process_ip", cfg["main_process_ip"])
    src.choice("rdzv_backend", get("rdzv_backend", "static"), ["STATIC", "C10D"])
    _gpu_ids(src, get("gpu_ids", "all"))
    src.boolean("use_cpu", get("use_cpu", False))
    if not src.boolean("same_network", get("same_network", True)) and machines > 1:
        src.notice("same_network", "is not applied: shardwise launch reaches main_process_ip "
                   "as given")
    for key, why in (("debug", "is not applied (set TORCH_DISTRIBUTED_DEBUG yourself)"),
                     ("enable_cpu_affinity", "is not applied (pin threads yourself)")):
        if src.boolean(key, get(key, False)):
            src.notice(key, why)
    if src.text("main_training_function", get("main_training_function", "main")) != "main":
        src.notice("main_training_function", "is not applied: shardwise launch runs the script")


def _asks(value: Any) -> bool:
    """Whether a value of a key with no meaning here asks for something (what ``accelerate
    config`` writes for "not used" — false, no, none, empty — does not)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "no", "none", "false")
    return value not in (None, False, 0) and not (isinstance(value, (list, dict, tuple))
                                                  and not value)


def uses_cpu(src: Source) -> bool:
    """An Accelerate config's ``use_cpu``."""
    return src.data.get("use_cpu") is not None and src.boolean("use_cpu", src.data["use_cpu"])


def _no(value: Any, default: str) -> Any:
    """YAML 1.1 reads an unquoted ``no`` as false: here it is the ``"no"`` it was."""
    return default if value is False or value is None else value


def _parallelism(src: Source, mesh: dict[str, Any], out: list[Transform], kind: str,
                 fsdp: dict[str, Any], env: Env) -> list[Transform]:
    """The ``parallelism_config`` block; as Accelerate, only beside FSDP version 2."""
    version = fsdp.get("fsdp_version", fsdp.get("version", 1))
    if asks_for_mesh(src, mesh) and (kind != "FSDP" or version != 2):
        raise ConfigError.at(src.origin, f"parallelism_config needs distributed_type: FSDP with "
                          f"fsdp_config.fsdp_version: 2, as in Accelerate (got distributed_type="
                          f"{kind}, fsdp_version={version!r})")
    return parallelism_transforms(src, mesh, out, env)


def accelerate_transforms(src: Source, env: Env) -> list[Transform]:
    """Transforms for an Accelerate config mapping."""
    cfg = src.data
    src.check_keys(cfg, TOP | {k for k in cfg if k.startswith("tpu_")})
    for key in sorted(k for k in cfg if k in IGNORED or k.startswith("tpu_")):
        shape, why = IGNORED.get(key, (None, _TPU))
        if shape is not None:
            src.check_shape(key, cfg[key], shape)
        if _asks(cfg[key]):
            src.notice(key, why)
    _launch(src, cfg)
    kind = src.choice("distributed_type", _no(cfg.get("distributed_type"), "NO"), _KINDS)
    raw = _no(cfg.get("mixed_precision"), "no")
    if isinstance(raw, str) and raw.lower() == "fp8":
        raise src.fail("mixed_precision", raw, "no, fp16, bf16 (fp8 is not supported)")
    precision = src.choice("mixed_precision", raw, ["NO", "FP16", "BF16"]).lower()
    blocks = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED"}
    block = {key: src.mapping(key, cfg.get(key)) for key in blocks}
    for key, needs in blocks.items():
        if block[key] and kind != needs:
            src.notice(key, f"is not applied: distributed_type is {kind}, not {needs}")
    compiled = dynamo_transforms(src, src.mapping("dynamo_config", cfg.get("dynamo_config")))
    if kind == "DEEPSPEED":  # precision is one of its settings (the file may give it too)
        settings = read_block(src, block["deepspeed_config"], precision)
        return [*build(src, settings, env), *compiled]
    out: list[Transform] = []
    if kind in ("MULTI_CPU", "MULTI_GPU"):
        out.append(replicate())
    elif kind == "FSDP":
        out += fsdp_transforms(src, block["fsdp_config"], "fsdp_config.")
    mesh = src.mapping("parallelism_config", cfg.get("parallelism_config"))
    if mesh:
        out = _parallelism(src, mesh, out, kind, block["fsdp_config"], env)
    out += compiled
    if precision == "no":  # Accelerate's full precision, said explicitly: fp32, not a default
        return [*out, mixed_precision("fp32")] if "mixed_precision" in cfg else out
    return [*out, mixed_precision(precision)]
