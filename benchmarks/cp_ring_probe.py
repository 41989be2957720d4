# Probe: torch's own context-parallel attention (its flex path) on 2 gloo CPU ranks vs whole-sequence SDPA.
"""Whether torch's context-parallel attention can stand behind ``context_parallel(method="ring")``
on a CPU: its SDPA path needs CUDA's kernels (docs/parallelism.md); this runs its flex path
(``_ContextParallel(attention_type=FLEX)``: keys and values all-gathered, each rank's queries
against them under ``_create_cp_block_mask``) on 2 gloo ranks, causal attention over 256
tokens sharded by torch's own ``_context_parallel_shard`` and default load balancer (the
layout the mask assumes), then a backward through it, and prints each rank's largest difference from
``scaled_dot_product_attention`` over the whole sequence, how long the block mask took, and
what the backward did.

    OMP_NUM_THREADS=1 python benchmarks/cp_ring_probe.py
"""
import time

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing import run_distributed


def job() -> str:
    """In each rank: the flex path on its slice, compared with the whole sequence's SDPA."""
    sw.ensure_process_group(sw.detect())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _create_cp_block_mask,
        _create_default_load_balancer,
    )
    from torch.nn.attention.flex_attention import flex_attention
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    S = 256
    q, k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    class Attn(torch.nn.Module):
        def forward(self, query, key, value, block_mask=None):
            return flex_attention(query, key, value, block_mask=block_mask)
    flex = _ContextParallel.AttentionType.FLEX
    attn = _ContextParallel(seq_dim=2, attention_type=flex)._apply(Attn(), mesh)
    balancer = _create_default_load_balancer(S, 2, "cpu")  # what the mask assumes
    mine = _context_parallel_shard(mesh, [q, k, v, whole], [2, 2, 2, 2], balancer)
    t = time.perf_counter()
    try:
        mask = _create_cp_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 2, S, S, mesh,
                                     load_balancer=balancer)
    except Exception as e:
        return f"block mask: {type(e).__name__}: {str(e)[:300]}"
    made = time.perf_counter() - t
    try:
        out = attn(*mine[:3], block_mask=mask)
    except Exception as e:
        return f"attention: {type(e).__name__}: {str(e)[:300]}"
    diff = (out - mine[3]).abs().max().item()
    said = f"forward: max difference {diff:.2e}, block mask built in {made:.1f} s; backward: "
    local = [t.clone().requires_grad_(True) for t in mine[:3]]
    try:
        attn(*local, block_mask=mask).sum().backward()
    except Exception as e:
        return said + f"{type(e).__name__}: {str(e)[:200]}"
    return said + "ran"

if __name__ == "__main__":
    print(run_distributed(job, world_size=2, timeout=600))
