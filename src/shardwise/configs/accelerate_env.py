# The variables `accelerate launch` hands to the script, read as the Accelerate config they came from.
"""``ACCELERATE_*`` / ``FSDP_*`` / ``PARALLELISM_CONFIG_*`` variables -> an Accelerate config
mapping -> transforms.

``accelerate launch --config_file cfg.yaml train.py`` does not pass the YAML on: it sets
variables (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ...).
They are turned back into the YAML's keys and read by the same reader as the file, so the
script builds the pipeline ``shardwise launch --config_file cfg.yaml`` would.
"""

from __future__ import annotations

from typing import Any

from shardwise._config_source import Source
from shardwise.configs.accelerate import accelerate_transforms
from shardwise.env import Env
from shardwise.transforms.accumulation import accumulate_gradients
from shardwise.transforms.base import Transform

__all__ = ["ORIGIN", "launched_by_accelerate", "read_accelerate_variables"]

ORIGIN = "accelerate launch's variables"
_FSDP = {  # variable -> fsdp_config key
    "FSDP_VERSION": "fsdp_version", "FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy",
    "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward",
    "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params", "FSDP_MIN_NUM_PARAMS": "fsdp_min_num_params",
    "FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    "FSDP_BACKWARD_PREFETCH": "fsdp_backward_prefetch",
    "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type", "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch",
    "FSDP_USE_ORIG_PARAMS": "fsdp_use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
    "FSDP_SYNC_MODULE_STATES": "fsdp_sync_module_states",
    "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing"}
#: what the launcher writes for a setting the YAML did not give: asks for nothing
_LAUNCHER_DEFAULTS = {"FSDP_FORWARD_PREFETCH": "false", "FSDP_USE_ORIG_PARAMS": "true",
                      "FSDP_SYNC_MODULE_STATES": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD":
                      "false", "ACCELERATE_DYNAMO_MODE": "default",
                      "ACCELERATE_DYNAMO_USE_FULLGRAPH": "false",
                      "ACCELERATE_DYNAMO_USE_DYNAMIC": "false",
                      "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "false",
                      "ACCELERATE_CONFIG_DS_FIELDS": None}
_DEEPSPEED = {  # variable -> deepspeed_config key
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config_file",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "deepspeed_moe_layer_cls_names"}
#: variable -> parallelism_config key (set by accelerate launch --use_parallelism_config)
_PARALLELISM = {f"PARALLELISM_CONFIG_{k.upper()}": f"parallelism_config_{k}"
                for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                          "cp_backend", "cp_comm_strategy", "sp_size", "sp_backend",
                          "sp_seq_length", "sp_seq_length_is_variable",
                          "sp_attn_implementation")}
_TOP = {"ACCELERATE_MIXED_PRECISION": "mixed_precision", "ACCELERATE_USE_CPU": "use_cpu",
        "ACCELERATE_DEBUG_MODE": "debug", "ACCELERATE_CPU_AFFINITY": "enable_cpu_affinity"}
_FLAGS = {"ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG",
          "ACCELERATE_DYNAMO_BACKEND",
          "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_USE_MEGATRON_LM",
          "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "FSDP_IGNORED_MODULES"}
#: variables other than settings (logging, tooling) that change nothing in training
_QUIET = {"ACCELERATE_LOG_LEVEL", "ACCELERATE_DISABLE_RICH", "ACCELERATE_CONFIG_DS_FIELDS"}
_TRUE = ("1", "true", "yes", "y", "on", "t")


def _flag(value: str) -> bool:
    return value.strip().lower() in _TRUE


def _typed(key: str, value: str) -> Any:
    """A variable's text as the YAML value it was written from."""
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if key.endswith(("version", "num_params", "zero_stage", "_size")) and text.isdigit():
        return int(text)
    if key == "gradient_clipping":
        try:
            return float(text)
        except ValueError:
            return text
    return text


def _to_config(variables: dict[str, str], env: Env) -> tuple[dict[str, Any], dict[str, str]]:
    """(the Accelerate config the variables say, each dotted key -> its variable)."""
    cfg: dict[str, Any] = {}
    names: dict[str, str] = {}
    block: dict[str, Any] = {}

    def put(block: dict[str, Any], where: str, key: str, var: str) -> None:
        block[key] = _typed(key, variables[var])
        names[f"{where}{key}"] = var

    for var, key in _TOP.items():
        if var in variables:
            put(cfg, "", key, var)
    if _flag(variables.get("ACCELERATE_USE_DEEPSPEED", "")):
        cfg["distributed_type"] = "DEEPSPEED"
        for var, key in _DEEPSPEED.items():
            if var in variables:
                put(block, "deepspeed_config.", key, var)
        if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in variables:
            put(block, "deepspeed_config.", "gradient_accumulation_steps",
                "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        cfg["deepspeed_config"] = block
    elif _flag(variables.get("ACCELERATE_USE_FSDP", "")):
        cfg["distributed_type"] = "FSDP"
        v2 = variables.get("FSDP_VERSION", "1").strip() == "2"
        for var, key in _FSDP.items():
            if var not in variables or _LAUNCHER_DEFAULTS.get(var) == variables[var].lower():
                continue
            if var == "FSDP_SHARDING_STRATEGY" and (v2 or "FSDP_RESHARD_AFTER_FORWARD" in
                                                    variables):
                continue  # written for old scripts; reshard_after_forward says it
            if var == "FSDP_MIN_NUM_PARAMS" and \
                    variables.get("FSDP_AUTO_WRAP_POLICY") != "SIZE_BASED_WRAP":
                continue  # always written; used by size-based wrapping only
            put(block, "fsdp_config.", key, var)
        cfg["fsdp_config"] = block
    else:
        cfg["distributed_type"] = "NO" if env.world_size == 1 else \
            "MULTI_CPU" if env.device.type == "cpu" else "MULTI_GPU"
    if _flag(variables.get("ACCELERATE_USE_PARALLELISM_CONFIG", "")):
        mesh: dict[str, Any] = {}
        for var, key in _PARALLELISM.items():
            if var in variables and variables[var].strip() not in ("", "None"):
                put(mesh, "parallelism_config.", key, var)
        cfg["parallelism_config"] = mesh
    backend = variables.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if backend != "NO":
        dynamo: dict[str, Any] = {}
        for var in sorted(v for v in variables if v.startswith("ACCELERATE_DYNAMO_")):
            put(dynamo, "dynamo_config.", var.removeprefix("ACCELERATE_").lower(), var)
        cfg["dynamo_config"] = dynamo
    return cfg, names


def launched_by_accelerate(env: Env) -> bool:
    """Whether ``env`` holds settings of ``accelerate launch`` (not just its logging ones)."""
    return any(name not in _QUIET for name, _ in env.accelerate_variables)


def read_accelerate_variables(env: Env) -> tuple[list[Transform], list[str]]:
    """The transforms and notices of the variables ``accelerate launch`` set (in
    ``env.accelerate_variables``), read as the Accelerate config they came from.

    Raises:
        ConfigError: a value the config reader refuses, naming the variable.
    """
    variables = dict(env.accelerate_variables)
    src = Source({}, ORIGIN)
    if _flag(variables.get("ACCELERATE_USE_MEGATRON_LM", "")):
        raise src.fail("ACCELERATE_USE_MEGATRON_LM", variables["ACCELERATE_USE_MEGATRON_LM"],
                       "false (Megatron-LM is not driven by shardwise)")
    for var in ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "FSDP_IGNORED_MODULES"):
        if var in variables and variables[var].lower() not in ("false", ""):
            src.notice(var, "is not applied (no FSDP2 counterpart here)")
    known = {*_FSDP, *_DEEPSPEED, *_TOP, *_FLAGS, *_QUIET, *_LAUNCHER_DEFAULTS, *_PARALLELISM}
    for var in sorted(set(variables) - known):
        src.notice(var, "is not read by shardwise")
    cfg, names = _to_config(variables, env)
    config = Source(cfg, ORIGIN, written=names)  # its messages name the variables
    out = accelerate_transforms(config, env)
    steps = variables.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps is not None and cfg["distributed_type"] != "DEEPSPEED":
        count = config.integer("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps.strip(), 1)
        if count > 1:
            out.append(accumulate_gradients(count))
    return out, [*src.notices, *config.notices]
