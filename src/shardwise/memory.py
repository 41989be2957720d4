# Per-rank memory estimate: parameters, gradients, optimizer state, activations, working set.
"""``estimate_memory``: how many bytes each rank needs under a pipeline."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from shardwise import precision as precisions
from shardwise.engines import Engine
from shardwise.env import Env
from shardwise.policies import Policy, select
from shardwise.precision import Precision
from shardwise.transforms.activation_checkpointing import CheckpointActivations
from shardwise.transforms.base import Distribution, Transform, plan_for
from shardwise.transforms.expert_parallelism import ExpertParallel
from shardwise.transforms.optimizer_sharding import ShardOptimizer
from shardwise.transforms.replication import replicate


class _HasTransforms(Protocol):
    """A :class:`shardwise.Pipeline` (its env and transforms are read)."""

    @property
    def env(self) -> Env: ...

    @property
    def transforms(self) -> tuple[Transform, ...]: ...


__all__ = ["MemoryEstimate", "estimate_memory", "SAFE_FRACTION", "budget"]

_MIB = 2**20
#: The share of device memory a rank plans to fill (the default pipeline's choice, ``fits``).
SAFE_FRACTION = 0.8


def budget(env: Env) -> int | None:
    """Bytes one rank may plan to use: a safe share of its device (of host RAM split by the
    node's ranks on a CPU), or None when the memory is unknown."""
    if env.device_memory_bytes is None:
        return None
    share = env.local_world_size if env.device.type == "cpu" else 1
    return int(env.device_memory_bytes * SAFE_FRACTION / share)


@attrs.frozen
class MemoryEstimate:
    """Bytes one rank needs on its device. ``str()`` gives a table.

    Attributes:
        params_bytes: fp32 master parameters at rest, and buffers; under ``shard()`` the
            largest shard (rank 0's: FSDP2 pads every rank's storage to it, while the last
            ranks of a large world may see fewer rows, or none, of a tensor).
        grads_bytes: gradients between backward and the optimizer step (unsharded while
            ``accumulate_gradients`` under ``shard()`` skips reduction, unless
            ``sync_each_batch``).
        optimizer_bytes: optimizer state, from the optimizer's own state layout (of the
            largest shard: the state of a rank's unpadded rows is less on the last ranks).
        activations_bytes: distinct tensors saved for backward for the sample batch, other
            than parameters (None: no batch, or the model cannot run on the meta device).
        working_bytes: parameters gathered for compute under shard (blocks in flight).
        total_bytes: the sum of the above.
        layout: what was estimated, e.g. "shard over 4 ranks + offload".
        budget_bytes: what one rank may plan to use (``SAFE_FRACTION`` of its device; of
            host RAM split by the node's ranks on a CPU), None when unknown.
        activations_missing: why ``activations_bytes`` is None ("" when measured).
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int | None
    working_bytes: int
    total_bytes: int
    layout: str
    budget_bytes: int | None = None
    activations_missing: str = ""

    @property
    def fits(self) -> bool | None:
        """Whether the total fits ``budget_bytes``; None when a term is unknown (the
        activations, see ``activations_missing``, or the device's memory)."""
        if self.activations_bytes is None or self.budget_bytes is None:
            return None
        return self.total_bytes <= self.budget_bytes

    def __str__(self) -> str:
        rows = [("parameters", self.params_bytes), ("gradients", self.grads_bytes),
                ("optimizer state", self.optimizer_bytes),
                ("activations", self.activations_bytes),
                ("gathered for compute", self.working_bytes), ("total", self.total_bytes)]
        lines = [f"per-rank memory ({self.layout})"]
        for name, value in rows:
            shown = "not measured" if value is None else f"{value / _MIB:10.2f} MiB"
            lines.append(f"  {name:<22}{shown:>16}")
        if self.activations_missing:
            lines.append(f"  activations not measured: {self.activations_missing}")
        if self.budget_bytes is not None:
            verdict = {True: "fits", False: "does not fit", None: "cannot tell"}[self.fits]
            lines.append(f"  budget {self.budget_bytes / _MIB:.2f} MiB: {verdict}")
        return "\n".join(lines)


def _optimizer_layout(optimizer: torch.optim.Optimizer | None) -> tuple[float, float]:
    """(bytes per parameter element, bytes per parameter tensor) of the optimizer's state,
    measured by stepping a copy of its class on two probe tensors. Default: AdamW."""
    cls = type(optimizer) if optimizer is not None else torch.optim.AdamW
    defaults = dict(optimizer.defaults) if optimizer is not None else {}
    sizes = []
    for numel in (1024, 2048):
        probe = nn.Parameter(torch.zeros(numel))
        try:
            probe_opt = cls([probe], **{k: v for k, v in defaults.items()
                                        if k not in ("params", "decoupled_weight_decay")})
            probe.grad = torch.zeros(numel)
            probe_opt.step()
        except Exception:  # an optimizer that needs a closure or more: assume AdamW's layout
            return 8.0, 4.0
        sizes.append(sum(v.numel() * v.element_size() for v in probe_opt.state[probe].values()
                         if isinstance(v, torch.Tensor)))
    per_element = (sizes[1] - sizes[0]) / 1024
    return per_element, sizes[0] - per_element * 1024


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _block_meter(blocks: list[nn.Module], counter: list[int],
                 per_block: list[tuple[int, int]]) -> Iterator[None]:
    """Record (bytes saved inside, input bytes) for each block's forward."""
    handles = []
    for block in blocks:
        start: dict[str, int] = {}

        def pre(module: nn.Module, args: tuple[Any, ...], start: dict[str, int] = start) -> None:
            start["saved"] = counter[0]
            start["inputs"] = sum(a.numel() * a.element_size() for a in args
                                  if isinstance(a, torch.Tensor))

        def post(module: nn.Module, args: Any, out: Any, start: dict[str, int] = start) -> None:
            per_block.append((counter[0] - start["saved"], start["inputs"]))

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _FusedAttention(TorchFunctionMode):
    """On the meta device, ``scaled_dot_product_attention`` saves for backward what a fused
    kernel (flash, memory-efficient: what runs on a GPU and for a CPU's mask-free attention)
    saves: query, key, value, output and one statistic per row, not the ``S x S`` weights of
    the math kernel the meta device would otherwise dispatch to."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or len(args) < 3:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        if key.shape[-3] != query.shape[-3]:  # grouped-query attention (enable_gqa)
            key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], -3)
                          for t in (key, value))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(query, key, value, kwargs.get("dropout_p", 0.0),
                     bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale"))[0]


def _activations(model: nn.Module, batch: Any, precision: Precision,
                 checkpointed: Policy | None) -> tuple[int | None, str]:
    """Bytes saved for backward by one forward of ``batch``, run on the meta device; None
    and why when the forward cannot run there."""
    dtype = precisions.dtype(precision)
    params = {n: torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else None)
              .requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()}
    batch = tree_map(_to_meta, batch)
    counter: list[int] = [0]
    per_block: list[tuple[int, int]] = []
    # storages are told apart by their C handle; parameters and buffers are not activations
    seen = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            counter[0] += storage.nbytes()
        return t

    blocks = [m for _, m in select(checkpointed, model, user="estimate_memory")] \
        if checkpointed is not None else []
    try:
        with _block_meter(blocks, counter, per_block), _FusedAttention(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if isinstance(batch, Mapping):
                functional_call(model, {**params, **buffers}, (), dict(batch))
            elif isinstance(batch, (tuple, list)):
                functional_call(model, {**params, **buffers}, tuple(batch))
            else:
                functional_call(model, {**params, **buffers}, (batch,))
    except Exception as exc:  # data-dependent code cannot run on meta tensors
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return None, (f"the model's forward cannot run on the meta device ({type(exc).__name__}: "
                      f"{first}); it reads values of tensors (.item(), data-dependent shapes "
                      "or control flow), which a meta tensor does not have. The other terms "
                      "are exact; measure the activations with one step on the device")
    if not per_block:
        return counter[0], ""
    inside = sum(saved for saved, _ in per_block)
    kept_inputs = sum(inputs for _, inputs in per_block)
    return counter[0] - inside + kept_inputs + max(saved for saved, _ in per_block), ""


def _transforms(pipeline: _HasTransforms | Sequence[Transform] | None) -> list[Transform]:
    if pipeline is None:
        return []
    return list(pipeline if isinstance(pipeline, Sequence) else pipeline.transforms)


def engine_of(transforms: Sequence[Transform], env: Env) -> Engine:
    """The engine ``transforms`` would put in a bundle under ``env`` (none given: replicate,
    or under tensor or pipeline parallelism shard() over the data ranks, or the splitting
    transform's own engine when its groups span the world)."""
    plan = plan_for(env, transforms)
    distribution = next((t for t in transforms if isinstance(t, Distribution)), None)
    from shardwise.default_split import split_default

    default = split_default(env, transforms)
    if distribution is None and default is not None:
        if not default[0]:
            if plan.tensor_parallel is not None:
                return plan.tensor_parallel.engine(env, plan)
            from shardwise.engines import LocalEngine

            return LocalEngine()  # each rank its stages, nothing shared
        distribution = default[0][0]  # type: ignore[assignment]
    engine = (distribution or replicate()).engine(env, plan)
    if env.is_distributed and any(isinstance(t, ShardOptimizer) for t in transforms):
        engine = engine.with_sharded_optimizer(None)
    return engine


def _staged(model: nn.Module, staged: Any, env: Env, plan: Any, transforms: list[Transform],
            batch: Any, optimizer: torch.optim.Optimizer | None) -> MemoryEstimate:
    """The estimate under ``pipeline_parallel``: the rank whose stages need the most, their
    state and their activations for the microbatches the schedule keeps in flight."""
    from shardwise._params import unwrap
    from shardwise.parallel.pp_memory import (
        held_modules,
        in_flight,
        microbatch,
        stage_activations,
    )

    model = unwrap(model)
    engine = engine_of(transforms, env)  # one process, or FSDP2 over each stage's data ranks
    sliced = plan.size("cp")
    ckpt = next((t for t in transforms if isinstance(t, CheckpointActivations)), None)
    size, count = plan.size("pp"), staged.microbatch_count(plan)
    split = staged.split_for(model, plan)
    schedule = staged.kind  # the schedule's record: torch's order, each rank's stages
    order = schedule.order(size, count)
    trained = ({id(p) for g in optimizer.param_groups for p in g["params"]}
               if optimizer is not None else {id(p) for p in model.parameters() if p.requires_grad})
    per_stage: list[int | None] = []
    missing = "no sample batch was given (batch=...)"
    if batch is not None:
        reasons: list[str] = []

        def measure(stage: nn.Module, inputs: Any) -> int | None:
            found, why = _activations(stage, inputs, plan.precision,
                                      ckpt.policy if ckpt is not None else None)
            reasons.append(why)
            return found

        per_stage = stage_activations(model, split, microbatch(batch, count), measure,
                                      precisions.dtype(plan.precision))
        missing = next((why for why in reasons if why), "")
        # each rank of a context-parallel group a 1/cp slice of every sequence
        per_stage = [-(-a // sliced) if a is not None else None for a in per_stage]
    best: tuple[int, int, Any, int | None] | None = None
    experts = next((t for t in transforms if isinstance(t, ExpertParallel)), None)
    for rank in range(size):
        held = held_modules(model, split, schedule.stages_on(rank, size))
        mine = trained & {id(p) for p in held.parameters()}
        parts = engine.memory(
            held, env, trained=mine, optimizer_layout=_optimizer_layout(optimizer),
            precision_bytes=precisions.dtype(plan.precision).itemsize,
            accumulating=plan.accumulation_steps > 1)
        if experts is not None and experts.ep_size(env, plan.mesh) > 1:  # its stages' experts
            parts, with_experts = _experts_split(
                held, experts, env, engine, parts, parts.layout, mine, optimizer, batch,
                precisions.dtype(plan.precision).itemsize, plan.mesh)
            parts = attrs.evolve(parts, layout=with_experts)
        activations = None if not per_stage or any(a is None for a in per_stage) else \
            in_flight(order[rank], lambda s: per_stage[s] or 0)
        total = (parts.params_bytes + parts.grads_bytes + parts.optimizer_bytes
                 + (activations or 0) + parts.working_bytes)
        if best is None or total > best[1]:
            best = (rank, total, parts, activations)
    assert best is not None
    rank, total, parts, activations = best
    layout = (f"pipeline parallel over {size} ranks ({staged.schedule}, {count} microbatches): "
              f"rank {rank} needs the most, holding stages "
              f"{schedule.stages_on(rank, size)} ({parts.layout}); activations of "
              "the microbatches its schedule keeps in flight"
              + (f" + context parallel over {sliced} (each a 1/{sliced} slice)" if sliced > 1
                 else "") + (" + activation checkpointing" if ckpt else ""))
    return MemoryEstimate(parts.params_bytes, parts.grads_bytes, parts.optimizer_bytes,
                          activations, parts.working_bytes, total, layout, budget(env),
                          missing if activations is None else "")


def _experts_split(model: nn.Module, experts: ExpertParallel, env: Env, engine: Engine,
                   parts: Any, layout: str, trained: set[int],
                   optimizer: torch.optim.Optimizer | None, batch: Any,
                   precision_bytes: int, layout_of_plan: Any = None) -> tuple[Any, str]:
    """``parts`` with each rank holding ``1/ep`` of the expert stacks (beside ``shard()``
    with replica groups, split again across them as FSDP2 splits them: the engine's count
    of each stack is replaced by that), and the dispatch's rows in the working bytes: each
    MoE layer's rows sent and received, kept for backward (every token's choices, in the
    compute precision; the sample batch's ``input_ids``)."""
    from shardwise.engines.fsdp import FSDPEngine, shard_numel
    from shardwise.parallel.mesh import data_share
    from shardwise.parallel.moe_dispatch import expert_stacks, held_numel
    from shardwise.transforms.expert_parallelism import experts_modules

    size = experts.ep_size(env, layout_of_plan)
    data = data_share(env, layout_of_plan)[0]
    found = experts_modules(model, experts.experts)
    stacks = [p for _, module in found for p in expert_stacks(module).values()]
    fsdp = isinstance(engine, FSDPEngine)
    copies = data // size if fsdp else 1  # FSDP2 splits them again across the replicas

    def counted(p: torch.Tensor) -> int:  # what the engine's count gave the stack
        if isinstance(engine, FSDPEngine):
            return shard_numel(tuple(p.shape), engine.shard_ranks)
        return p.numel()

    if stacks:
        gone = sum(counted(p) - held_numel(tuple(p.shape), size, copies) for p in stacks)
        trained_gone = sum(counted(p) - held_numel(tuple(p.shape), size, copies)
                           for p in stacks if id(p) in trained)
        per_element, _ = _optimizer_layout(optimizer)
        parts = attrs.evolve(parts, params_bytes=int(parts.params_bytes - gone * 4),
                             grads_bytes=int(parts.grads_bytes - trained_gone * 4),
                             optimizer_bytes=int(parts.optimizer_bytes - trained_gone * per_element))
    config = getattr(model, "config", None)
    choices = getattr(config, "num_experts_per_tok", None)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    dispatch = 0
    if isinstance(choices, int) and isinstance(ids, torch.Tensor) and found:
        width = int(getattr(config, "hidden_size", 0))
        dispatch = len(found) * 2 * ids.numel() * choices * width * precision_bytes
    layout += f" + experts split over {size} ranks (1/{size} of every expert stack each" + (
        f", sharded again across {copies} replicas)" if copies > 1 else ")")
    if dispatch:
        parts = attrs.evolve(parts, working_bytes=parts.working_bytes + dispatch)
        layout += f" + the dispatch's rows ({dispatch / 2**20:.1f} MiB)"
    return parts, layout


def estimate_memory(model: nn.Module, pipeline: _HasTransforms | Sequence[Transform] | None = None,
                    env: Env | None = None,
                    *, batch: Any = None,
                    optimizer: torch.optim.Optimizer | None = None) -> MemoryEstimate:
    """Estimate the bytes each rank needs to train ``model`` under ``pipeline``.

    Parameters and gradients are counted in fp32 (master weights), sharded as FSDP2 splits
    dim 0 under ``shard()``; optimizer state follows the optimizer's own layout, measured by
    stepping its class on a probe (default AdamW: two fp32 moments); activations are the
    tensors saved for backward by a forward of ``batch`` (one rank's micro-batch) on the
    meta device, in the plan's precision (attention saving what a fused kernel saves, not
    the math kernel's ``S x S`` weights), reduced as ``checkpoint_activations`` would, and
    divided by the group's size under ``context_parallel`` (each rank holds a slice of every
    sequence; give the whole batch a data rank reads). Under ``pipeline_parallel`` the rank
    whose stages need the most: their state, and each stage's activations for one
    microbatch times the microbatches torch's schedule keeps in flight on that rank.

    Args:
        model: the model (not modified, nothing is allocated for it).
        pipeline: the pipeline (or a list of transforms) to estimate; ``None`` means one
            replica per rank.
        env: defaults to the pipeline's env (or one process).
        batch: a sample micro-batch, or tensors of its shapes.
        optimizer: the optimizer to take the state layout from.

    Example:
        >>> print(sw.estimate_memory(model, sw.pipeline(env, sw.shard()), batch=batch))
    """
    if env is None:
        env = getattr(pipeline, "env", None) or Env()
    transforms = _transforms(pipeline)
    plan = plan_for(env, transforms)
    staged = plan.pipeline_parallel
    if staged is not None and env.is_distributed and plan.size("pp") > 1:
        return _staged(model, staged, env, plan, transforms, batch, optimizer)
    engine = engine_of(transforms, env)
    ckpt = next((t for t in transforms if isinstance(t, CheckpointActivations)), None)
    trained = ({id(p) for g in optimizer.param_groups for p in g["params"]}
               if optimizer is not None else {id(p) for p in model.parameters() if p.requires_grad})
    parts = engine.memory(model, env, trained=trained, optimizer_layout=_optimizer_layout(optimizer),
                          precision_bytes=precisions.dtype(plan.precision).itemsize,
                          accumulating=plan.accumulation_steps > 1)
    activations, missing = None, "no sample batch was given (batch=...)"
    if batch is not None:
        activations, missing = _activations(model, batch, plan.precision,
                                            ckpt.policy if ckpt is not None else None)
    layout = parts.layout + (" + activation checkpointing" if ckpt is not None else "")
    experts = next((t for t in transforms if isinstance(t, ExpertParallel)), None)
    if experts is not None and env.is_distributed and experts.ep_size(env, plan.mesh) > 1:
        parts, layout = _experts_split(model, experts, env, engine, parts, layout, trained,
                                       optimizer, batch, precisions.dtype(plan.precision).itemsize,
                                       plan.mesh)
    split = plan.size("cp")
    if split > 1:  # each rank a 1/split slice of every sequence (and, in attention, of the heads)
        layout += f" + context parallel over {split} (activations of the whole batch / {split})"
        activations = -(-activations // split) if activations is not None else None
    total = (parts.params_bytes + parts.grads_bytes + parts.optimizer_bytes + (activations or 0)
             + parts.working_bytes)
    return MemoryEstimate(parts.params_bytes, parts.grads_bytes, parts.optimizer_bytes,
                          activations, parts.working_bytes, total, layout, budget(env), missing)
