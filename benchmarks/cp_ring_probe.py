# Probe: torch's own context-parallel attention (its flex path) on 2 gloo CPU ranks vs whole-sequence SDPA.
"""Whether torch's context-parallel attention can stand behind ``context_parallel(method="ring")``
on a CPU: its SDPA path needs CUDA's kernels (docs/parallelism.md); this runs its flex path
(``_ContextParallel(attention_type=FLEX)``: keys and values all-gathered, each rank's queries
against them under ``_create_cp_block_mask``) on 2 gloo ranks, causal attention over 256
tokens in contiguous slices, and prints each rank's largest difference from
``scaled_dot_product_attention`` over the whole sequence and how long the block mask took.

    OMP_NUM_THREADS=1 python benchmarks/cp_ring_probe.py
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing import run_distributed


def job() -> str:
    """In each rank: the flex path on its slice, compared with the whole sequence's SDPA."""
    sw.ensure_process_group(sw.detect())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel,
        _create_cp_block_mask,
    )
    from torch.nn.attention.flex_attention import flex_attention
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    S = 256
    q, k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    class Attn(torch.nn.Module):
        def forward(self, query, key, value, block_mask=None):
            return flex_attention(query, key, value, block_mask=block_mask)
    flex = _ContextParallel.AttentionType.FLEX
    attn = _ContextParallel(seq_dim=2, attention_type=flex)._apply(Attn(), mesh)
    t = time.perf_counter()
    try:
        mask = _create_cp_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 2, S, S, mesh)
    except Exception as e:
        return f"block mask: {type(e).__name__}: {str(e)[:300]}"
    made = time.perf_counter() - t
    part = slice(rank * S // 2, (rank + 1) * S // 2)
    try:
        out = attn(q[:, :, part], k[:, :, part], v[:, :, part], block_mask=mask)
    except Exception as e:
        return f"attention: {type(e).__name__}: {str(e)[:300]}"
    diff = (out - whole[:, :, part]).abs().max().item()
    return f"ran: max difference {diff:.2e}, block mask built in {made:.1f} s"

if __name__ == "__main__":
    print(run_distributed(job, world_size=2, timeout=600))
