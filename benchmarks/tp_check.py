# Under torchrun on 2+ GPUs: tensor_parallel(size=2) against one GPU (parity) and beside shard() (ms/step).
"""The tensor-parallel row of ``gpu_check.sh``: run by ``torchrun --nproc_per_node=2`` on a
machine with 2+ CUDA devices (NCCL). Every rank trains a small Llama 4 optimizer steps under
``tensor_parallel(size=2)`` and under ``shard()`` on the same global batches; rank 0 also
trains it alone and prints the largest parameter difference of each against it, and the
median ms/step of each (bf16, the default on these GPUs). Exits 1 if fp32 parity is above
1e-4 (the GPU's reduced-precision matmuls, TF32 off), 2 without 2 CUDA devices.

    torchrun --nproc_per_node=2 benchmarks/tp_check.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw
from shardwise.testing import full_state, max_param_diff

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 64


def train(parts: list[sw.Transform], precision: str, data_ranks: int) -> tuple[dict, float]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    env = sw.detect()
    bundle = sw.pipeline(env, *parts, sw.mixed_precision(precision))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 4096, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    share = GLOBAL_BATCH // data_ranks
    mine = ids[(env.rank % data_ranks) * share:][:share].to(env.device)
    state, times = bundle.init(), []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        began = time.perf_counter()
        state, _ = bundle.step(state, {"input_ids": mine, "labels": mine})
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1000)
    bundle.check(state)
    return full_state(bundle.model), statistics.median(times[1:])


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or \
            int(os.environ.get("WORLD_SIZE", "1")) != 2:
        print("tp_check: needs 2 CUDA devices and torchrun --nproc_per_node=2", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = {}
    for precision in ("fp32", "bf16"):
        rows[("tensor_parallel(size=2)", precision)] = train([sw.tensor_parallel(size=2)],
                                                             precision, 1)
        rows[("shard()", precision)] = train([sw.shard()], precision, 2)
    if sw.detect().rank != 0:
        return 0
    failed = 0
    print("| pipeline | precision | ms/step | max param diff vs one GPU |\n|---|---|---|---|")
    for precision in ("fp32", "bf16"):
        alone = train_alone(precision)
        for (name, p), (params, ms) in rows.items():
            if p != precision:
                continue
            diff = max_param_diff(params, alone)
            failed |= precision == "fp32" and diff > 1e-4
            print(f"| {name} | {precision} | {ms:.1f} | {diff:.2e} |")
    return int(failed)


def train_alone(precision: str) -> dict:
    """The same model and global batches in this process alone (no process group)."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE") if k in os.environ}
    try:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
        model = LlamaForCausalLM(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 4096, (GLOBAL_BATCH, SEQ),
                            generator=torch.Generator().manual_seed(0)).cuda()
        for _ in range(STEPS):
            with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    finally:
        os.environ.update(saved)


if __name__ == "__main__":
    sys.exit(main())
