# The three implementations compare.py times: hand-written torch, shardwise, Accelerate.
"""What ``benchmarks/compare.py`` runs: its rows, the model, and one builder per
implementation (each returns ``step(batch) -> loss`` for one micro-batch), plus what differs
on CUDA (the group, the batches' way to the device, the clock). Its docstring says exactly
what each implementation does."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

IMPLS = ("hand-written", "shardwise", "accelerate")
MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
             tie_word_embeddings=False)
BATCH, SEQ, LR, WORLD = 4, 128, 1e-4, 2
# what each imports beyond torch (hand-written: only the FSDP2 rows; DDP comes with torch)
IMPORTS = {"hand-written": "from torch.distributed.fsdp import fully_shard",
           "shardwise": "import shardwise", "accelerate": "import accelerate"}


@dataclasses.dataclass(frozen=True)
class Row:
    engine: str  # "ddp" | "fsdp2"
    precision: str = "fp32"  # "fp32" | "bf16"
    accumulate: int = 1
    # fewer timing and fresh rounds where a round costs more: a window of 4 batches per block;
    # bf16, whose matmuls are emulated on a CPU without AVX512-BF16 (10-20x slower than fp32)
    rounds_divisor: int = 1
    default: bool = True  # in the default run (the others with --rows)


ROWS = {
    "ddp": Row("ddp"),
    "fsdp2": Row("fsdp2"),
    "ddp-bf16": Row("ddp", "bf16", rounds_divisor=8),
    "fsdp2-bf16": Row("fsdp2", "bf16", rounds_divisor=8, default=False),
    "ddp-accum4": Row("ddp", accumulate=4, rounds_divisor=2),
    "fsdp2-accum4": Row("fsdp2", accumulate=4, rounds_divisor=2),
}


# ---- the three implementations; each returns step(batch) -> loss, for one micro-batch ----

def _model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def _adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def hand_written(row: Row, device: str) -> tuple[Callable[[Any], Any], str]:
    import torch

    _init_group(device)
    model, bf16 = _model().to(device), row.precision == "bf16"
    autocast: Callable[[], Any] = contextlib.nullcontext

    def sync(on: bool) -> Any:  # one process (--device cuda): nothing to synchronise
        return contextlib.nullcontext()
    if device == "cuda":
        # what one writes for one GPU, and what shardwise (and Accelerate's DDP) run at world
        # size 1: the plain model, bf16 by autocast
        if bf16:
            autocast = functools.partial(torch.autocast, device, dtype=torch.bfloat16)
    elif row.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)

        def sync(on: bool) -> Any:
            return contextlib.nullcontext() if on else model.no_sync()
        if bf16:
            autocast = functools.partial(torch.autocast, device, dtype=torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

        def sync(on: bool) -> Any:
            model.set_requires_gradient_sync(on)
            return contextlib.nullcontext()
    optimizer, window, seen = _adamw(model), row.accumulate, [0]

    def step(batch: Any) -> Any:
        seen[0] += 1
        last = seen[0] % window == 0
        with sync(last):
            with autocast():
                loss = model(**batch).loss
            (loss / window if window > 1 else loss).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss
    return step, _note("", model, device)


def with_shardwise(row: Row, device: str) -> tuple[Callable[[Any], Any], str]:
    import shardwise as sw

    model = _model()
    engine = sw.replicate() if row.engine == "ddp" else sw.shard(sw.by_class("LlamaDecoderLayer"))
    parts = [sw.detect(), engine, sw.mixed_precision(row.precision)]
    if row.accumulate > 1:
        parts.append(sw.accumulate_gradients(row.accumulate))
    bundle = sw.pipeline(*parts)(model, _adamw(model))
    state = [bundle.init()]

    def step(batch: Any) -> Any:
        state[0], out = bundle.step(state[0], batch)
        return out.loss
    return step, _note("", bundle.model, device)


def with_accelerate(row: Row, device: str) -> tuple[Callable[[Any], Any], str]:
    from accelerate import Accelerator, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
    ) if row.engine == "fsdp2" else None
    precision = "no" if row.precision == "fp32" else row.precision
    accelerator = Accelerator(
        cpu=device == "cpu", mixed_precision=precision, gradient_accumulation_steps=row.accumulate,
        fsdp_plugin=plugin,
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=25,
                                                       gradient_as_bucket_view=True)])
    note = ""
    if plugin is not None and accelerator.distributed_type != DistributedType.FSDP:
        # on CPU Accelerate keeps MULTI_CPU and would wrap in DDP: force its FSDP2 path
        note = f"FSDP2 forced: Accelerate chose {accelerator.distributed_type.value}"
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        if precision != "no":
            plugin.set_mixed_precision(precision)
    model = _model()
    model, optimizer = accelerator.prepare(model, _adamw(model))

    def step(batch: Any) -> Any:
        with accelerator.accumulate(model) if row.accumulate > 1 else contextlib.nullcontext():
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss
    return step, _note(note, model, device)


BUILDERS = {"hand-written": hand_written, "shardwise": with_shardwise,
            "accelerate": with_accelerate}


def _note(note: str, model: Any, device: str) -> str:
    """On CUDA (world size 1), ``note`` and the class the model trains as: which one wrapped."""
    return note if device == "cpu" else "; ".join(filter(None, [note, type(model).__name__]))


# ---- what differs on CUDA: the group, the batches' way to the device, the clock ----

def world(device: str) -> int:
    """Ranks per job: one on CUDA, since NCCL cannot put two ranks on one GPU."""
    return 1 if device == "cuda" else WORLD


def _init_group(device: str) -> None:
    """The default process group, once: gloo on CPU, NCCL on cuda:0."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    """``batch`` on ``device``; on CUDA from pinned memory with ``non_blocking``, for all three."""
    if device == "cpu":
        return batch
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _sync(device: str) -> None:
    """Wait for the GPU's queued work before a clock is read (nothing to wait for on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
