# Ulysses context parallelism: each rank holds a slice of the sequence; attention runs on a slice of heads.
"""The attention exchange of Ulysses sequence parallelism (DeepSpeed-Ulysses), the building
block ``context_parallel(method="ulysses")`` is made of.

Each rank of a context-parallel group holds a contiguous slice of every sequence (rank r the
r-th of ``size`` equal slices). Around attention one all-to-all turns that into a slice of
the heads over the whole sequence, the attention kernel runs unchanged (any kernel, the CPU
included: it sees whole sequences), and a second all-to-all turns the result back. Both
exchanges are differentiable (torch's functional ``all_to_all_single_autograd``), so the
backward runs the same exchanges in reverse. Heads must divide by the group's size; key and
value heads that do not (grouped-query attention) are repeated to the query heads first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.errors import ConflictError

__all__ = ["ulysses_attention", "sequence_slice"]

#: ``attend(query, key, value) -> output``, each ``[batch, heads, sequence, head_dim]``
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` split along dim 0 into one chunk per rank, chunk j sent to rank j; what arrives
    stacked along dim 0 by sending rank."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    out = all_to_all_single_autograd(x.contiguous(), None, None, group)
    return wait_tensor(out)


def _to_heads(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, S/size, D]`` (a sequence slice) -> ``[B, H/size, S, D]`` (a heads slice)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)  # by receiving rank
    got = _exchange(chunks, group)  # [size: sequence slice of each rank, B, H/size, S/size, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_sequence(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H/size, S, D]`` (a heads slice) -> ``[B, H, S/size, D]`` (a sequence slice)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4)  # by receiving rank
    got = _exchange(chunks, group)  # [size: heads slice of each rank, B, H/size, S/size, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, size * h, s // size, d)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attend: Attend, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over the whole sequence for tensors that hold this rank's slice of it.

    Args:
        query: ``[batch, heads, sequence slice, head_dim]``.
        key, value: ``[batch, kv_heads, sequence slice, head_dim]``.
        attend: the attention over whole sequences, called on this rank's slice of the heads
            (e.g. causal ``scaled_dot_product_attention``).
        group: the context-parallel group (default: every rank).

    Returns:
        The attention output for this rank's sequence slice, ``[batch, heads, slice,
        head_dim]``.

    Raises:
        ConflictError: the heads do not divide by the group's size.
    """
    group = group if group is not None else dist.group.WORLD
    assert group is not None, "ulysses_attention() runs in a process group"
    size = dist.get_world_size(group)
    if size == 1:
        return attend(query, key, value)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ConflictError(f"Ulysses context parallelism splits the {heads} attention heads "
                            f"over {size} ranks, which does not divide them; use a size that "
                            f"divides {heads}, or method='ring'")
    if kv_heads % size:  # grouped-query attention with fewer key/value heads than ranks
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_to_heads(t, size, group) for t in (query, key, value))
    return _to_sequence(attend(q, k, v), size, group)


def sequence_slice(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``size`` equal ones along ``dim``.

    Raises:
        ConflictError: the length does not divide by ``size`` (named).
    """
    length = tensor.shape[dim]
    if length % size:
        raise ConflictError(f"context parallelism over {size} ranks needs sequences whose "
                            f"length divides by {size}; got length {length} (pad to a "
                            "multiple)")
    part = length // size
    return tensor.narrow(dim, rank * part, part)
