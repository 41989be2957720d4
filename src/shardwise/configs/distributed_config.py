# Transformers' DistributedConfig (tp/pp/fsdp sizes) mapped onto a pipeline's transforms.
"""A Transformers ``DistributedConfig`` (what ``from_pretrained(..., distributed_config=...)``
takes, or its ``to_dict()``) read as a config: each size becomes the transform that runs
that dimension, so the model is loaded whole and shardwise cuts, splits and shards it.

- ``pp_size``: ``pipeline_parallel(size=pp_size)`` (scheduled, 1F1B; Transformers' own
  split is an even one run without a schedule);
- ``tp_size`` (``tp_plan`` None or ``"auto"``): ``tensor_parallel(size=tp_size)``, the
  model's own plan;
- ``fsdp_size``: ``shard()``; ``dp_replicate_size`` (the number of nodes):
  ``shard(replicate_across_nodes=True)`` (HSDP);
- ``fsdp_cpu_offload: true``: ``offload()``; ``fsdp_mixed_precision: true``:
  ``mixed_precision("bf16")`` (Transformers' policy: bf16 parameters, fp32 reduction), both
  only with FSDP (``fsdp_size`` or ``dp_replicate_size`` > 1), as Transformers reads them.
- ``ep_size`` (Transformers runs it inside its FSDP ranks): ``expert_parallel(size=ep_size)``
  beside the ``shard()`` of ``fsdp_size`` (the world size), when ``ep_size`` divides it
  (``ep_implementation`` ``"auto"`` or ``"all_to_all"``).

Refused by name: other expert-parallel layouts, ``ep_plan``, ``ep_implementation``
``"all_reduce"`` and the rest,
``enable_sequence_parallel`` (not wired up in Transformers either), a ``tp_plan`` or
``fsdp_plan`` dict (Transformers merges it into the model's plan, which a config read before
the model cannot; pass ``tensor_parallel(plan=...)`` / ``shard(policy=...)`` in code), sizes
whose product is not the world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise._config_source import Source
from shardwise.env import Env
from shardwise.errors import ConfigError
from shardwise.transforms.base import Transform

__all__ = ["KEYS", "MARKERS", "distributed_config_transforms", "as_mapping"]

#: every field of Transformers 5.25's DistributedConfig
KEYS = ("tp_size", "tp_plan", "enable_sequence_parallel", "enable_expert_parallel",
        "fsdp_size", "dp_replicate_size", "fsdp_plan", "fsdp_cpu_offload",
        "fsdp_mixed_precision", "pp_size", "ep_size", "ep_plan", "ep_implementation")
#: keys that only a DistributedConfig has (how its dict is recognised)
MARKERS = frozenset({"pp_size", "tp_size", "fsdp_size", "dp_replicate_size", "ep_size",
                     "tp_plan", "fsdp_plan", "ep_plan", "enable_expert_parallel",
                     "enable_sequence_parallel", "ep_implementation"})


def as_mapping(source: Any) -> Any:
    """A Transformers ``DistributedConfig`` object as its dict; anything else unchanged."""
    if type(source).__name__ == "DistributedConfig" and callable(getattr(source, "to_dict", None)):
        return dict(source.to_dict())
    return source


def _size(src: Source, key: str) -> int:
    value = src.data.get(key)
    return 1 if value is None else src.integer(key, value, 1)


def _refuse_unsupported(src: Source) -> None:
    data = src.data
    ep = _size(src, "ep_size")
    if ep == 1 and src.boolean("enable_expert_parallel", data.get("enable_expert_parallel", False)):
        raise ConfigError.at(src.origin, "enable_expert_parallel=True without ep_size: set "
                             "ep_size to the ranks the experts are split over (every rank)")
    if data.get("ep_plan") is not None:
        raise ConfigError.at(src.origin, "ep_plan is set: shardwise finds the experts modules "
                             "itself (Transformers 5's *Experts); leave it out (None), or pass "
                             "sw.expert_parallel(experts=...) in code")
    if data.get("ep_implementation", "auto") not in ("auto", "all_to_all"):
        raise src.fail("ep_implementation", data["ep_implementation"],
                       "'auto' or 'all_to_all' (sw.expert_parallel dispatches tokens by "
                       "all-to-all)")
    if src.boolean("enable_sequence_parallel", data.get("enable_sequence_parallel", False)):
        raise ConfigError.at(src.origin, "enable_sequence_parallel=True: Transformers reserves it "
                             "(not wired up); for long sequences use sw.context_parallel(size=...)")
    for key, instead in (("tp_plan", "sw.tensor_parallel(plan={...})"),
                         ("fsdp_plan", "sw.shard(policy=...)")):
        value = data.get(key)
        if value is not None and value != "auto":
            raise ConfigError.at(src.origin, f"{key}={value!r}: Transformers merges it into the "
                                 "model's own plan, which a config read before the model cannot "
                                 f"do; leave it out (the model's plan) and pass {instead} in code "
                                 "with the whole plan")


def distributed_config_transforms(src: Source, env: Env) -> list[Transform]:
    """The transforms a Transformers ``DistributedConfig`` (its fields as a mapping) asks for.

    Raises:
        ConfigError: unknown keys, sizes that are not positive integers or do not multiply to
            the world size, a replicate size other than the number of nodes, expert or
            sequence parallelism, a plan dict.
    """
    from shardwise.transforms.offloading import offload
    from shardwise.transforms.pipeline_parallelism import pipeline_parallel
    from shardwise.transforms.precision_policy import mixed_precision
    from shardwise.transforms.sharding import shard
    from shardwise.transforms.tensor_parallelism import tensor_parallel

    src.check_keys(src.data, KEYS)
    _refuse_unsupported(src)
    data: Mapping[str, Any] = src.data
    pp, fsdp, replicas = _size(src, "pp_size"), _size(src, "fsdp_size"), \
        _size(src, "dp_replicate_size")
    tp = _size(src, "tp_size")
    if data.get("tp_size") is None and data.get("tp_plan") is not None:  # Transformers: the rest
        tp = max(1, env.world_size // (pp * fsdp * replicas))
    product = pp * fsdp * replicas * tp
    if not env.is_distributed:  # one process: every size runs as a no-op (explain(), notebooks)
        src.notice("sizes", f"(pp {pp} x fsdp {fsdp} x dp_replicate {replicas} x tp {tp}) are "
                   "for several processes: one process runs the model whole")
    elif product != env.world_size:
        raise ConfigError.at(src.origin, f"pp_size={pp} x fsdp_size={fsdp} x dp_replicate_size="
                             f"{replicas} x tp_size={tp} = {product} ranks, but this run has "
                             f"{env.world_size}; choose sizes whose product is the world size")
    if env.is_distributed and replicas > 1 and replicas != env.num_nodes:
        raise ConfigError.at(src.origin, f"dp_replicate_size={replicas}: shardwise replicates "
                             f"across nodes and shards within one (HSDP), and this run has "
                             f"{env.num_nodes} node(s); set it to the number of nodes")
    out: list[Transform] = []
    ep = _size(src, "ep_size")
    if ep > 1 and env.is_distributed:
        if (pp, tp, replicas) != (1, 1, 1) or fsdp % ep:
            raise ConfigError.at(src.origin, f"ep_size={ep} beside pp_size={pp}, tp_size={tp}, "
                                 f"dp_replicate_size={replicas}, fsdp_size={fsdp}: "
                                 "sw.expert_parallel splits the experts inside the FSDP ranks "
                                 "(ep_size a divisor of fsdp_size = the world size, the other "
                                 "sizes 1); other layouts are not built yet")
        from shardwise.transforms.expert_parallelism import expert_parallel

        out.append(expert_parallel(size=None if ep == fsdp else ep))
    if pp > 1:
        out.append(pipeline_parallel(size=pp))
    if tp > 1:
        out.append(tensor_parallel(size=tp))
    if fsdp > 1 or replicas > 1:
        out.append(shard(replicate_across_nodes=replicas > 1))
    sharded = fsdp * replicas > 1  # Transformers reads these two for fully_shard only
    for key, transform in (("fsdp_cpu_offload", offload()),
                           ("fsdp_mixed_precision", mixed_precision("bf16"))):
        if src.boolean(key, data.get(key, False)):
            if sharded:
                out.append(transform)
            else:
                src.notice(key, "is not applied: Transformers reads it for FSDP only, and "
                           "fsdp_size and dp_replicate_size are 1")
    if pp > 1 and fsdp * replicas > 1:
        src.notice("pp_size", f"={pp} beside fsdp_size={fsdp}: Transformers 5.25 refuses FSDP "
                   "with pipeline parallelism; shardwise shards each stage over its data ranks")
    return out
