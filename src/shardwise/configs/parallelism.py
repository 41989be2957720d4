# Accelerate's ParallelismConfig (dp_replicate x dp_shard x tp x cp) mapped onto transforms.
"""``parallelism_config`` (an Accelerate YAML block, the ``PARALLELISM_CONFIG_*`` variables
of ``accelerate launch``, or TrainingArguments' ``parallelism_config``) -> transforms.

The sizes say the mesh: ``tp_size`` becomes ``tensor_parallel(size=...)``, ``dp_shard_size``
the ``shard()`` of the FSDP settings (over the mesh's data dimension), ``dp_replicate_size``
HSDP across nodes (or DDP alone). Context and sequence parallelism are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from shardwise._config_source import Source, short
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.replication import Replicate, replicate
from shardwise.transforms.sharding import Shard, shard
from shardwise.transforms.tensor_parallelism import tensor_parallel

__all__ = ["PREFIX", "KEYS", "SIZES", "asks_for_mesh", "parallelism_transforms"]

PREFIX = "parallelism_config_"
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
#: the settings of context/sequence parallelism, read only when their size is > 1
_OTHER = ("cp_comm_strategy", "cp_backend", "cp_handler", "sp_backend", "sp_seq_length",
          "sp_seq_length_is_variable", "sp_attn_implementation", "sp_handler", "tp_handler")
KEYS = {*SIZES, *_OTHER}
_REFUSED = {
    "cp_size": "1 (context parallelism is not supported: torch's context_parallel splits only "
               "CUDA's SDPA kernels (on a CPU, aten._scaled_dot_product_flash_attention_for_cpu "
               "has no sharding strategy), which shardwise cannot test; save activations with "
               "checkpoint_activations, or split layers with tp_size)",
    "sp_size": "1 (sequence parallelism (DeepSpeed Ulysses) is not supported)"}


def _spellings(src: Source, block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The block's set values by bare key (no ``parallelism_config_`` prefix; null is unset).
    Both spellings are read, as Accelerate's YAML accepts both; the same key given with and
    without the prefix, with different values, is refused naming both as written (rather than
    one silently winning), as the FSDP keys' two spellings are (``configs.fsdp``)."""
    place = where.removesuffix(PREFIX)  # the block's dotted path, e.g. "parallelism_config."
    plain: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in block.items():
        bare = str(key).removeprefix(PREFIX)
        if value is None:
            continue
        if bare in plain and not (type(plain[bare]) is type(value) and plain[bare] == value):
            raise ConfigError.at(src.origin, f"{spelled[bare]}={short(plain[bare])} and "
                              f"{place}{key}={short(value)} contradict each other (the same "
                              f"setting, with and without the {PREFIX} prefix); keep one")
        plain.setdefault(bare, value)
        spelled.setdefault(bare, f"{place}{key}")
    return plain


def _sizes(src: Source, block: Mapping[str, Any], where: str) -> dict[str, int]:
    """``where`` names a key: ``parallelism_config.parallelism_config_`` in a YAML,
    ``parallelism_config.`` for TrainingArguments' fields."""
    sizes = {}
    for name in SIZES:
        value = block.get(name)
        sizes[name] = 1 if value is None else src.integer(f"{where}{name}", value, 1, 2**16)
    for name, accepted in _REFUSED.items():
        if sizes[name] > 1:
            raise src.fail(f"{where}{name}", sizes[name], accepted)
    return sizes


def _check_world(src: Source, sizes: dict[str, int], env: Env, where: str) -> None:
    product = sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"]
    shown = " x ".join(f"{where}{n}={sizes[n]}" for n in SIZES[:3])
    if env.is_distributed and product != env.world_size:
        raise ConfigError.at(src.origin, f"{shown} = {product} ranks, but this run has "
                          f"{env.world_size}; the sizes must multiply to the number of processes")
    replicas = sizes["dp_replicate_size"]
    if env.is_distributed and replicas > 1 and replicas != env.num_nodes:
        raise ConfigError.at(src.origin, f"{where}dp_replicate_size={replicas}, but this "
                          f"run has {env.num_nodes} node(s); shardwise replicates across nodes "
                          "and shards within one (HSDP): set it to the number of nodes")


def asks_for_mesh(src: Source, block: Mapping[str, Any],
                  where: str = f"parallelism_config.{PREFIX}") -> bool:
    """Whether ``block`` asks for more than one rank in some dimension (sizes checked)."""
    return any(size > 1 for size in _sizes(src, _spellings(src, block, where), where).values())


def parallelism_transforms(src: Source, block: Mapping[str, Any], given: list[Transform],
                           env: Env, where: str = f"parallelism_config.{PREFIX}"
                           ) -> list[Transform]:
    """``given`` (the FSDP/DDP settings' transforms) with the mesh ``block`` asks for.

    ``block``'s keys may carry the ``parallelism_config_`` prefix (YAML, variables) or not
    (a ``ParallelismConfig`` object's fields); ``where`` is how a key is named in messages.

    Raises:
        ConfigError: a key given with and without the prefix with different values, a size
            that is not a positive integer, context or sequence parallelism,
            sizes that do not multiply to the world size, a replicate size other than the
            number of nodes, or NO_SHARD with a shard size, naming the keys.
    """
    src.check_keys({f"{where}{str(k).removeprefix(PREFIX)}": k for k in block},
                   {f"{where}{k}" for k in KEYS})
    sizes = _sizes(src, _spellings(src, block, where), where)
    if all(size == 1 for size in sizes.values()):
        return given  # nothing asked: what the launcher writes when the block is unused
    _check_world(src, sizes, env, where)
    replicas, shards, tp = sizes["dp_replicate_size"], sizes["dp_shard_size"], sizes["tp_size"]
    out = [t for t in given if t.stage != Stage.DISTRIBUTION]
    distribution = next((t for t in given if t.stage == Stage.DISTRIBUTION), None)
    if tp > 1:
        out.append(tensor_parallel(size=tp))
    if shards > 1:
        if isinstance(distribution, Replicate):
            raise ConfigError.at(src.origin, f"{where}dp_shard_size={shards} needs FSDP "
                              "sharding, but the settings replicate the model (DDP, or FSDP's "
                              "NO_SHARD); set FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (fsdp=...)")
        base = distribution if isinstance(distribution, Shard) else shard()
        out.append(attrs.evolve(base, replicate_across_nodes=replicas > 1))
    elif replicas > 1:
        if tp > 1:
            raise ConfigError.at(src.origin, f"{where}dp_replicate_size={replicas} with "
                              f"{where}tp_size={tp} and dp_shard_size=1: beside tensor "
                              "parallelism the data ranks are sharded (FSDP2); set dp_shard_size")
        out.append(replicate())
    return out
