# Ulysses' exchange: attention on sequence slices equals attention on whole sequences, forward and backward.
# Its tests that start no process are in tests/unit/test_local_sgd_and_ulysses.py.
import pytest
import torch
import torch.nn.functional as F

from shardwise.parallel.ulysses import sequence_slice, ulysses_attention
from shardwise.testing import run_distributed

B, H, S, D = 2, 4, 8, 4


def whole(kv_heads):
    """Query, key, value over whole sequences and the output's weights, from one seed."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=generator)
    k = torch.randn(B, kv_heads, S, D, generator=generator)
    v = torch.randn(B, kv_heads, S, D, generator=generator)
    return q, k, v, torch.randn(B, H, S, D, generator=generator)


def causal(q, k, v):
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def on_slices(kv_heads):
    """This rank's slice of the output and of each input's gradient, under Ulysses."""
    import torch.distributed as dist

    import shardwise as sw

    sw.ensure_process_group(sw.detect())
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, weights = whole(kv_heads)
    parts = [sequence_slice(t, rank, size, dim=2).clone().requires_grad_(True) for t in (q, k, v)]
    out = ulysses_attention(*parts, causal)
    (out * sequence_slice(weights, rank, size, dim=2)).sum().backward()
    return out.detach(), [p.grad for p in parts]


@pytest.mark.parametrize("world, kv_heads", [(2, 4), (2, 2), (4, 2)],
                         ids=["cp2", "cp2-gqa", "cp4-gqa-repeated"])
def test_attention_on_sequence_slices_equals_attention_on_whole_sequences(world, kv_heads):
    """Causal attention under Ulysses on 2 and 4 gloo ranks: each rank's output slice and
    the gradients of its query, key and value slices equal one process's, to 1e-6 (key and
    value heads fewer than the ranks are repeated first)."""
    q, k, v, weights = whole(kv_heads)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = causal(*inputs)
    (out * weights).sum().backward()
    for rank, (got, grads) in enumerate(run_distributed(on_slices, kv_heads, world_size=world)):
        torch.testing.assert_close(got, sequence_slice(out.detach(), rank, world, dim=2),
                                   rtol=0, atol=1e-6)
        for grad, full in zip(grads, inputs, strict=True):
            torch.testing.assert_close(grad, sequence_slice(full.grad, rank, world, dim=2),
                                       rtol=0, atol=1e-6)
