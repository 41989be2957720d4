# Accelerate's ParallelismConfig (dp_replicate x dp_shard x tp x cp) mapped onto transforms.
"""``parallelism_config`` (an Accelerate YAML block, the ``PARALLELISM_CONFIG_*`` variables
of ``accelerate launch``, or TrainingArguments' ``parallelism_config``) -> transforms.

The sizes say the mesh: ``tp_size`` becomes ``tensor_parallel(size=...)``, ``dp_shard_size``
the ``shard()`` of the FSDP settings (over the mesh's data dimension), ``dp_replicate_size``
HSDP across nodes (or DDP alone). ``cp_size`` (Accelerate's context parallel) and
``sp_size`` (DeepSpeed's Ulysses sequence parallel) both become ``context_parallel(size=...)``:
Ulysses' all-to-alls, the same numbers as torch's ring attention with another exchange (a
notice says so for ``cp_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from shardwise._config_source import Source, short
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.base import Stage, Transform
from shardwise.transforms.context_parallelism import context_parallel
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
#: the values each setting of context/sequence parallelism may take (Accelerate's own)
_CHOICES = {"cp_backend": ("torch",), "cp_comm_strategy": ("allgather", "alltoall"),
            "sp_backend": ("deepspeed",)}
#: settings that would choose what shardwise does not do, refused when set (size > 1)
_UNHONOURED = {
    "cp_handler": "unset (a TorchContextParallelConfig chooses torch's ring exchange; "
                  "shardwise runs Ulysses: set cp_comm_strategy, or nothing)",
    "sp_handler": "unset (the DeepSpeed sequence-parallel settings object; shardwise runs "
                  "Ulysses itself)",
    "sp_seq_length": "unset (shardwise splits each batch's own length, any multiple of sp_size)",
    "sp_seq_length_is_variable": "unset or true (each batch's own length is split)",
    "sp_attn_implementation": "unset (the model's own attention implementation runs on whole "
                              "sequences)"}


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
            raise ConfigError.at(src.origin, f"{src.key(spelled[bare])}={short(plain[bare])} and "
                              f"{src.key(f'{place}{key}')}={short(value)} contradict each other (the same "
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
    if sizes["cp_size"] > 1 and sizes["sp_size"] > 1:
        raise ConfigError.at(src.origin, f"{src.key(f'{where}cp_size')}={sizes['cp_size']} and "
                             f"{src.key(f'{where}sp_size')}={sizes['sp_size']}: both split "
                             "sequences; set one of them to 1 (as Accelerate requires)")
    return sizes


def _sequence_settings(src: Source, block: Mapping[str, Any], sizes: dict[str, int],
                       where: str) -> None:
    """Check the settings of the sequence split asked for: Accelerate's values, nothing that
    would choose what shardwise does not do; a notice where its exchange differs."""
    for name in ("cp", "sp"):
        if sizes[f"{name}_size"] == 1:
            continue
        for key, options in _CHOICES.items():
            if key.startswith(name) and block.get(key) is not None:
                if block[key] not in options:
                    raise src.fail(f"{where}{key}", block[key], ", ".join(options))
        for key, accepted in _UNHONOURED.items():
            value = block.get(key)
            if key.startswith(name) and value is not None and not (
                    key == "sp_seq_length_is_variable" and value is True):
                raise src.fail(f"{where}{key}", value, accepted)
    if sizes["cp_size"] > 1:
        src.notice(f"{where}cp_size", "runs as sw.context_parallel(method='ulysses'): all-to-alls "
                   "of heads around each attention rather than torch's ring (which splits CUDA's "
                   "SDPA only); the same numbers, another exchange")


def _check_world(src: Source, sizes: dict[str, int], env: Env, where: str) -> None:
    product = 1
    for name in SIZES:
        product *= sizes[name]
    shown = " x ".join(f"{src.key(where + n)}={sizes[n]}" for n in SIZES if sizes[n] > 1 or n in SIZES[:3])
    if env.is_distributed and product != env.world_size:
        raise ConfigError.at(src.origin, f"{shown} = {product} ranks, but this run has "
                          f"{env.world_size}; the sizes must multiply to the number of processes")
    replicas = sizes["dp_replicate_size"]
    if env.is_distributed and replicas > 1 and replicas != env.num_nodes:
        raise ConfigError.at(src.origin, f"{src.key(f'{where}dp_replicate_size')}={replicas}, but this "
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
            that is not a positive integer, both cp_size and sp_size, a setting of theirs
            shardwise cannot honour, sizes that do not multiply to the
            world size, a replicate size other than the
            number of nodes, or NO_SHARD with a shard size, naming the keys.
    """
    staged = [k for k in block if str(k).removeprefix(PREFIX) == "pp_size"]
    if staged:  # not Accelerate's (1.16 has no pipeline parallelism): say where it lives
        raise ConfigError.at(src.origin, f"{where}{str(staged[0]).removeprefix(PREFIX)}: "
                             "Accelerate's parallelism_config has "
                             "no pipeline size (Accelerate 1.16 has no pipeline parallelism); "
                             "pass sw.pipeline_parallel(size=...) to sw.pipeline in code, or "
                             "read a Transformers DistributedConfig(pp_size=...) with "
                             "sw.from_config")
    src.check_keys({f"{where}{str(k).removeprefix(PREFIX)}": k for k in block},
                   {f"{where}{k}" for k in KEYS})
    plain = _spellings(src, block, where)
    sizes = _sizes(src, plain, where)
    if all(size == 1 for size in sizes.values()):
        return given  # nothing asked: what the launcher writes when the block is unused
    _sequence_settings(src, plain, sizes, where)
    _check_world(src, sizes, env, where)
    replicas, shards, tp = sizes["dp_replicate_size"], sizes["dp_shard_size"], sizes["tp_size"]
    cp = sizes["cp_size"] * sizes["sp_size"]  # at most one of them > 1
    out = [t for t in given if t.stage != Stage.DISTRIBUTION]
    distribution = next((t for t in given if t.stage == Stage.DISTRIBUTION), None)
    if tp > 1:
        out.append(tensor_parallel(size=tp))
    if cp > 1:
        out.append(context_parallel(size=cp))
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
    elif cp > 1 and distribution is not None:  # FSDP2 (or DDP) over the dp x cp ranks
        out.append(distribution)
    return out
