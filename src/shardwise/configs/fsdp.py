# FSDP settings (Accelerate's fsdp_config block, Transformers' fsdp_config) mapped onto FSDP2.
"""FSDP keys -> shard / offload / checkpoint_activations / replicate."""

from __future__ import annotations

from typing import Any

from shardwise.configs._read import Source
from shardwise.errors import ConfigError
from shardwise.policies import Policy, auto, by_class, by_size, root_only
from shardwise.transforms.base import Transform
from shardwise.transforms.checkpoint_activations import checkpoint_activations
from shardwise.transforms.offload import offload
from shardwise.transforms.replicate import replicate
from shardwise.transforms.shard import shard

# keys that mean nothing under FSDP2: one notice each
NO_OP = {
    "use_orig_params": "is always true under FSDP2",
    "sync_module_states": "has no FSDP2 equivalent (rank 0's weights are broadcast by DDP, "
                          "or loaded by every rank)",
    "backward_prefetch": "is decided by FSDP2 itself",
    "forward_prefetch": "is decided by FSDP2 itself",
    "limit_all_gathers": "has no FSDP2 equivalent",
    "backward_prefetch_policy": "is decided by FSDP2 itself",
    "xla": "is for TPUs, which shardwise does not drive",
    "xla_fsdp_settings": "is for TPUs, which shardwise does not drive",
    "xla_fsdp_grad_ckpt": "is for TPUs, which shardwise does not drive",
    "xla_fsdp_v2": "is for TPUs, which shardwise does not drive",
}
KEYS = {"version", "sharding_strategy", "reshard_after_forward", "auto_wrap_policy",
        "transformer_layer_cls_to_wrap", "min_num_params", "offload_params", "cpu_offload",
        "activation_checkpointing", "state_dict_type", "cpu_ram_efficient_loading", *NO_OP}
STRATEGIES = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False),
              "HYBRID_SHARD": (True, True), "HYBRID_SHARD_ZERO2": (False, True)}
_NUMBERED = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
             "5": "HYBRID_SHARD_ZERO2"}


def _policy(src: Source, cfg: dict[str, Any], kind: str) -> Policy:
    if kind == "TRANSFORMER_BASED_WRAP":
        names = cfg.get("transformer_layer_cls_to_wrap")
        if names is None:
            return auto()
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        if not isinstance(names, list) or not names:
            raise src.fail("fsdp_transformer_layer_cls_to_wrap", names, "class names")
        return by_class(*names)
    if kind == "SIZE_BASED_WRAP":
        return by_size(src.integer("fsdp_min_num_params", cfg.get("min_num_params", 100_000_000), 1))
    if src.boolean("fsdp_activation_checkpointing", cfg.get("activation_checkpointing", False)):
        raise src.fail("fsdp_auto_wrap_policy", kind, "TRANSFORMER_BASED_WRAP or "
                       "SIZE_BASED_WRAP with fsdp_activation_checkpointing (NO_WRAP names no "
                       "blocks to checkpoint)")
    return root_only()


def _strategy(src: Source, cfg: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(reshard after forward, hybrid, no sharding) from ``sharding_strategy`` and/or
    ``reshard_after_forward`` (which Accelerate's FSDP v1 configs fill with a strategy name);
    two that disagree are refused naming both."""
    named: dict[str, str] = {}
    if "sharding_strategy" in cfg:
        raw = str(cfg["sharding_strategy"])
        named["fsdp_sharding_strategy"] = src.choice(
            "fsdp_sharding_strategy", _NUMBERED.get(raw, raw), [*STRATEGIES, "NO_SHARD"])
    reshard: bool | None = None
    value = cfg.get("reshard_after_forward")
    if isinstance(value, str) and value.upper() in (*STRATEGIES, "NO_SHARD"):
        named["fsdp_reshard_after_forward"] = value.upper()
    elif value is not None:
        reshard = src.boolean("fsdp_reshard_after_forward", value)
    if len(set(named.values())) > 1:
        raise ConfigError(f"{src.origin}: {' and '.join(f'{k}={v}' for k, v in named.items())} "
                          "contradict each other; set one strategy")
    strategy = next(iter(named.values()), None)
    if strategy == "NO_SHARD":
        return True, False, True
    resharded, hybrid = STRATEGIES.get(strategy or "FULL_SHARD", (True, False))
    if reshard is not None and strategy is not None and reshard != resharded:
        raise ConfigError(f"{src.origin}: fsdp_reshard_after_forward={reshard} contradicts "
                          f"fsdp_sharding_strategy={strategy}; set one")
    return (resharded if reshard is None else reshard), hybrid, False


def fsdp_transforms(src: Source, block: dict[str, Any]) -> list[Transform]:
    """Transforms for an FSDP block whose keys may carry the ``fsdp_`` prefix."""
    cfg: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in block.items():
        bare = key.removeprefix("fsdp_")
        if bare in cfg and cfg[bare] != value:
            raise ConfigError(f"{src.origin}: {spelled[bare]}={cfg[bare]!r} and {key}={value!r} "
                              "contradict each other (the same setting, with and without the "
                              "fsdp_ prefix); set one")
        cfg[bare], spelled[bare] = value, key
    src.check_keys(cfg, KEYS, " in the FSDP settings (shown without their fsdp_ prefix)")
    for key, why in NO_OP.items():
        if key in cfg:
            src.notice(f"fsdp_{key}", why)
    version = src.integer("fsdp_version", cfg.get("version", 1), 1)
    if version not in (1, 2):
        raise src.fail("fsdp_version", version, "1 or 2")
    reshard, hybrid, no_shard = _strategy(src, cfg)
    kind = src.choice("fsdp_auto_wrap_policy", cfg.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
                      ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"])
    policy = _policy(src, cfg, kind)
    offloads = {f"fsdp_{k}": src.boolean(f"fsdp_{k}", cfg[k])
                for k in ("offload_params", "cpu_offload") if k in cfg}
    if len(set(offloads.values())) > 1:
        raise ConfigError(f"{src.origin}: {' and '.join(f'{k}={v}' for k, v in offloads.items())}"
                          " contradict each other (the same setting under two names); set one")
    offload_on = any(offloads.values())
    checkpointing = src.boolean("fsdp_activation_checkpointing",
                                cfg.get("activation_checkpointing", False))
    out: list[Transform] = []
    if no_shard:  # NO_SHARD: replicate, honouring checkpointing; offload needs sharding
        if offload_on:
            raise ConfigError(f"{src.origin}: NO_SHARD with {next(k for k, v in offloads.items() if v)}"
                              "=true: offload needs a sharded strategy (FULL_SHARD, "
                              "SHARD_GRAD_OP, HYBRID_SHARD); choose one, or drop the offload")
        out.append(replicate())
    else:
        out.append(shard(policy, reshard_after_forward=reshard, replicate_across_nodes=hybrid))
        if offload_on:
            out.append(offload())
    if checkpointing:
        out.append(checkpoint_activations(policy))
    if "state_dict_type" in cfg:
        kind = src.choice("fsdp_state_dict_type", cfg["state_dict_type"],
                          ["SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"])
        if kind != "SHARDED_STATE_DICT":
            src.notice("fsdp_state_dict_type", f"{kind}: sw.save always writes sharded DCP "
                       "checkpoints; use sw.export for a full state dict")
    if src.boolean("fsdp_cpu_ram_efficient_loading", cfg.get("cpu_ram_efficient_loading", False)):
        src.notice("fsdp_cpu_ram_efficient_loading", "is done by building the model with "
                   "sw.init_on_meta(factory): rank 0 alone loads the weights, shard() hands "
                   "each rank its shards")
    return out
