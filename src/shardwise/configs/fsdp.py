# FSDP settings (Accelerate's fsdp_config block, Transformers' fsdp_config) mapped onto FSDP2.
"""FSDP keys -> shard / offload / checkpoint_activations / replicate."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardwise._config_source import Shape, Source, short
from shardwise.errors import ConfigError
from shardwise.policies import Policy, auto, by_class, by_size, root_only
from shardwise.transforms.activation_checkpointing import checkpoint_activations
from shardwise.transforms.base import Transform
from shardwise.transforms.offloading import offload
from shardwise.transforms.replication import replicate
from shardwise.transforms.sharding import shard

_XLA = "is for TPUs, which shardwise does not drive"
# keys that mean nothing under FSDP2: the shape each takes, and why it gives a notice
NO_OP: dict[str, tuple[Shape, str]] = {
    "use_orig_params": ("bool", "is always true under FSDP2"),
    "sync_module_states": ("bool", "has no FSDP2 equivalent (rank 0's weights are broadcast "
                                   "by DDP, or loaded by every rank)"),
    "backward_prefetch": ("text", "is decided by FSDP2 itself"),
    "forward_prefetch": ("bool", "is decided by FSDP2 itself"),
    "limit_all_gathers": ("bool", "has no FSDP2 equivalent"),
    "backward_prefetch_policy": ("text", "is decided by FSDP2 itself"),
    "xla": ("bool", _XLA), "xla_fsdp_settings": ("mapping", _XLA),
    "xla_fsdp_grad_ckpt": ("bool", _XLA), "xla_fsdp_v2": ("bool", _XLA),
}
KEYS = {"version", "sharding_strategy", "reshard_after_forward", "auto_wrap_policy",
        "transformer_layer_cls_to_wrap", "min_num_params", "offload_params", "cpu_offload",
        "activation_checkpointing", "state_dict_type", "cpu_ram_efficient_loading", *NO_OP}
STRATEGIES = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False),
              "HYBRID_SHARD": (True, True), "HYBRID_SHARD_ZERO2": (False, True)}
_NUMBERED = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
             "5": "HYBRID_SHARD_ZERO2"}
_WRAPS = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]

#: a key's name as written (with its block and its prefix, if any), from its bare name
Names = Callable[[str], str]


def _spellings(src: Source, block: Mapping[str, Any], where: str) -> tuple[dict[str, Any], Names]:
    """The block's set values by bare key (no ``fsdp_`` prefix; null is unset), and a function
    naming a bare key as written. The same key given with and without the prefix, with
    different values, is refused naming both."""
    cfg: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in block.items():
        bare = key.removeprefix("fsdp_")
        if value is None:
            continue
        if bare in cfg and not (type(cfg[bare]) is type(value) and cfg[bare] == value):
            raise ConfigError.at(src.origin, f"{src.key(spelled[bare])}={short(cfg[bare])} and "
                              f"{src.key(where + key)}={short(value)} contradict each other (the same "
                              "setting, with and without the fsdp_ prefix); keep one")
        cfg.setdefault(bare, value)
        spelled.setdefault(bare, f"{where}{key}")
    return cfg, lambda bare: src.key(spelled.get(bare, f"{where}fsdp_{bare}"))


def _class_names(src: Source, key: str, value: Any) -> tuple[str, ...]:
    """Class names: a comma-separated string, or a list of strings."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(
            isinstance(n, str) and n.strip().isidentifier() for n in names):
        raise src.fail(key, value, "class names (identifiers like LlamaDecoderLayer), as a "
                       "comma-separated string or a list")
    return tuple(n.strip() for n in names)


def _wrap_kind(src: Source, cfg: dict[str, Any], name: Names, size: int | None) -> str:
    """``auto_wrap_policy``; without it (Transformers' fsdp_config) the key given says which:
    ``min_num_params`` > 0 means by size, else by class."""
    if "auto_wrap_policy" in cfg:
        return src.choice(name("auto_wrap_policy"), cfg["auto_wrap_policy"], _WRAPS)
    if size and "transformer_layer_cls_to_wrap" in cfg:
        raise ConfigError.at(src.origin, f"{name('min_num_params')}={size} and "
                          f"{name('transformer_layer_cls_to_wrap')} ask for two wrapping "
                          f"policies (by size and by class); set one, or "
                          f"{name('auto_wrap_policy')}")
    return "SIZE_BASED_WRAP" if size else "TRANSFORMER_BASED_WRAP"


def _policy(src: Source, cfg: dict[str, Any], name: Names, checkpointing: bool) -> Policy:
    """The blocks to shard (and checkpoint); a key the policy does not use gives a notice."""
    classes = None if "transformer_layer_cls_to_wrap" not in cfg else _class_names(
        src, name("transformer_layer_cls_to_wrap"), cfg["transformer_layer_cls_to_wrap"])
    size = None if "min_num_params" not in cfg else src.integer(name("min_num_params"),
                                                                 cfg["min_num_params"])
    kind = _wrap_kind(src, cfg, name, size)
    if classes is not None and kind != "TRANSFORMER_BASED_WRAP":
        src.notice(name("transformer_layer_cls_to_wrap"), f"is not used with {kind}")
    if size and kind != "SIZE_BASED_WRAP":
        src.notice(name("min_num_params"), f"is not used with {kind}")
    if kind == "TRANSFORMER_BASED_WRAP":
        return auto() if classes is None else by_class(*classes)
    if kind == "SIZE_BASED_WRAP":
        return by_size(src.integer(name("min_num_params"), cfg.get("min_num_params",
                                                                   100_000_000), 1))
    if checkpointing:
        raise src.fail(name("auto_wrap_policy"), kind, "TRANSFORMER_BASED_WRAP or "
                       f"SIZE_BASED_WRAP with {name('activation_checkpointing')} (NO_WRAP names "
                       "no blocks to checkpoint)")
    return root_only()


def _strategy_name(src: Source, key: str, value: Any) -> str:
    """A sharding strategy by name or by FSDP1's number (1-5)."""
    text = value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 5:
        text = _NUMBERED[str(value)]
    elif isinstance(value, str):
        text = _NUMBERED.get(value.strip(), value)
    return src.choice(key, text, [*STRATEGIES, "NO_SHARD"])


def _strategy(src: Source, cfg: dict[str, Any], name: Names) -> tuple[bool, bool, bool]:
    """(reshard after forward, hybrid, no sharding) from ``sharding_strategy`` and/or
    ``reshard_after_forward`` (which Accelerate's FSDP v1 configs fill with a strategy name);
    two that disagree are refused naming both."""
    named: dict[str, str] = {}
    if "sharding_strategy" in cfg:
        key = name("sharding_strategy")
        named[key] = _strategy_name(src, key, cfg["sharding_strategy"])
    reshard: bool | None = None
    value = cfg.get("reshard_after_forward")
    if isinstance(value, str) and value.upper() in (*STRATEGIES, "NO_SHARD"):
        named[name("reshard_after_forward")] = value.upper()
    elif value is not None:
        reshard = src.boolean(name("reshard_after_forward"), value)
    if len(set(named.values())) > 1:
        raise ConfigError.at(src.origin, f"{' and '.join(f'{k}={v}' for k, v in named.items())} "
                          "contradict each other; set one strategy")
    strategy = next(iter(named.values()), None)
    if strategy == "NO_SHARD":
        return True, False, True
    resharded, hybrid = STRATEGIES.get(strategy or "FULL_SHARD", (True, False))
    if reshard is not None and strategy is not None and reshard != resharded:
        raise ConfigError.at(src.origin, f"{name('reshard_after_forward')}={reshard} contradicts "
                          f"{next(iter(named))}={strategy}; set one")
    return (resharded if reshard is None else reshard), hybrid, False


def _offload(src: Source, cfg: dict[str, Any], name: Names) -> str | None:
    """The key (as written) that turns offload on, None if off; two names for the setting
    that disagree are refused naming both."""
    offloads = {name(k): src.boolean(name(k), cfg[k]) for k in ("offload_params", "cpu_offload")
                if k in cfg}
    if len(set(offloads.values())) > 1:
        raise ConfigError.at(src.origin, f"{' and '.join(f'{k}={v}' for k, v in offloads.items())}"
                          " contradict each other (the same setting under two names); set one")
    return next((k for k, on in offloads.items() if on), None)


def _notices(src: Source, cfg: dict[str, Any], name: Names) -> None:
    """One notice for each key with no meaning under FSDP2 (after checking its shape), and
    for the state dict type and CPU-RAM-efficient loading, which other calls take care of."""
    for key, (shape, why) in NO_OP.items():
        if key in cfg:
            src.check_shape(name(key), cfg[key], shape)
            src.notice(name(key), why)
    if "state_dict_type" in cfg:
        kind = src.choice(name("state_dict_type"), cfg["state_dict_type"],
                          ["SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"])
        if kind != "SHARDED_STATE_DICT":
            src.notice(name("state_dict_type"), f"{kind}: sw.save always writes sharded DCP "
                       "checkpoints; use sw.export for a full state dict")
    if src.boolean(name("cpu_ram_efficient_loading"), cfg.get("cpu_ram_efficient_loading", False)):
        src.notice(name("cpu_ram_efficient_loading"), "is done by building the model with "
                   "sw.init_on_meta(factory): rank 0 alone loads the weights, shard() hands "
                   "each rank its shards")


def fsdp_transforms(src: Source, block: Mapping[str, Any], where: str = "") -> list[Transform]:
    """Transforms for an FSDP block (at dotted path ``where``, e.g. ``"fsdp_config."``) whose
    keys may carry the ``fsdp_`` prefix."""
    place = where.rstrip(".") or "the FSDP settings"
    src.check_keys({k.removeprefix("fsdp_"): k for k in block}, KEYS,
                   f"{place} (keys shown without their fsdp_ prefix)")
    cfg, name = _spellings(src, block, where)
    _notices(src, cfg, name)
    src.integer(name("version"), cfg.get("version", 1), 1, 2)
    reshard, hybrid, no_shard = _strategy(src, cfg, name)
    checkpointing = src.boolean(name("activation_checkpointing"),
                                cfg.get("activation_checkpointing", False))
    policy = _policy(src, cfg, name, checkpointing)
    offload_key = _offload(src, cfg, name)
    out: list[Transform] = []
    if no_shard:  # NO_SHARD: replicate, honouring checkpointing; offload needs sharding
        if offload_key:
            raise ConfigError.at(src.origin, f"NO_SHARD with {offload_key}=true: offload needs a "
                              "sharded strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD); "
                              "choose one, or drop the offload")
        out.append(replicate())
    else:
        out.append(shard(policy, reshard_after_forward=reshard, replicate_across_nodes=hybrid))
        if offload_key:
            out.append(offload())
    if checkpointing:
        out.append(checkpoint_activations(policy))
    return out
