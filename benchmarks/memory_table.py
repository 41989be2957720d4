# Per-rank memory at 2 CPU ranks: replicate, shard, shard + offload, + activation checkpointing.
"""Measured and estimated per-rank bytes for several pipelines, side by side in one run.

Measured: this rank's parameters, gradients and optimizer state after a step and a
backward (local shards under shard), and the distinct non-parameter tensors one forward
saves for backward (the estimate adds one block's recompute under checkpointing, the peak
of backward, which a forward alone does not show).
Estimated: ``sw.estimate_memory`` for the same pipeline and batch. On a CPU-only machine
offloading moves nothing (the device is the host), so its measured bytes equal shard's;
the estimate gives the accelerator bytes it would free.

    python benchmarks/memory_table.py
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.testing import TinyTransformerLM, run_distributed

CONFIGS = {
    "replicate": [sw.replicate()],
    "shard": [sw.shard()],
    "shard + offload": [sw.shard(), sw.offload()],
    "shard + checkpointing": [sw.shard(), sw.checkpoint_activations()],
    "shard + ckpt + offload": [sw.shard(), sw.checkpoint_activations(), sw.offload()],
}
MIB = 2**20


def nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(parts: list[sw.Transform]) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=128, heads=4, layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    estimate = sw.estimate_memory(model, parts, sw.detect(), batch=batch, optimizer=opt)
    bundle = sw.pipeline(sw.detect(), *parts)(model, opt)
    state, _ = bundle.step(bundle.init(), batch)
    saved = [0]
    # distinct storages, parameters excluded: what the forward keeps alive for backward
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # FSDP2 registers the gathered parameters on the modules during their forward
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()
                   if not isinstance(p, DTensor)}
        if storage.data_ptr() not in seen and storage.data_ptr() not in weights:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = bundle.model(**batch)["loss"]
    loss.backward()
    params = list(bundle.model.parameters())
    opt_state = [v for s in bundle.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
    state_bytes = (sum(nbytes(p) for p in params)
                   + sum(nbytes(p.grad) for p in params if p.grad is not None)
                   + sum(nbytes(v) for v in opt_state))
    return {"state": state_bytes / MIB, "activations": saved[0] / MIB,
            "est_state": (estimate.params_bytes + estimate.grads_bytes
                          + estimate.optimizer_bytes) / MIB,
            "est_activations": (estimate.activations_bytes or 0) / MIB,
            "est_total": estimate.total_bytes / MIB}


def all_configs() -> dict[str, dict[str, float]]:
    return {name: measure(parts) for name, parts in CONFIGS.items()}


def main() -> None:
    rows = run_distributed(all_configs, world_size=2, timeout=600)[0]
    print("per-rank MiB at 2 gloo ranks, rank 0 (tiny LM: dim 128, 6 layers, batch 8x64, AdamW)")
    print(f"  {'pipeline':<24}{'measured':>10}{'estimate':>10}{'measured':>12}{'estimate':>10}"
          f"{'estimate':>10}")
    print(f"  {'':<24}{'state':>10}{'state':>10}{'activations':>12}{'activ.':>10}{'total':>10}")
    for name, row in rows.items():
        print(f"  {name:<24}{row['state']:>10.2f}{row['est_state']:>10.2f}"
              f"{row['activations']:>12.2f}{row['est_activations']:>10.2f}{row['est_total']:>10.2f}")


if __name__ == "__main__":
    main()
