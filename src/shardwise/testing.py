# Test helpers shipped with the package: real multi-process runs on CPU, tiny models, data.
"""Helpers to test pipelines for real: start N ranks, compare runs, tiny models.

Example:
    >>> def train(n):
    ...     bundle = sw.pipeline(sw.detect())(TinyMLP(), ...)
    ...     return n * 2
    >>> run_distributed(train, 3, world_size=2)
    [6, 6]
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from shardwise._net import free_port
from shardwise.distributed import leave_group
from shardwise.errors import RankFailedError

__all__ = [
    "run_distributed", "process_context", "free_port", "full_state", "PeakGrowth",
    "max_param_diff", "TinyMLP",
    "TinyTransformerLM", "TinyDecoderBlock", "SyntheticTokens", "SyntheticRegression",
]


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int,
               port: int, queue: Any, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's variables as they are now, as a spawned process has them
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        # by value: shared-memory tensors would vanish when this process exits
        message: tuple[int, bool, bytes | str] = (rank, True, pickle.dumps(fn(*args)))
    except BaseException:
        message = (rank, False, traceback.format_exc())
    queue.put(message)  # a SimpleQueue writes before put() returns
    if not message[1]:
        os._exit(1)  # do not wait at an exit barrier the other ranks may never reach
    leave_group()  # the group the pipeline started: exit barrier on the store, then destroyed
    if dist.is_initialized():
        dist.destroy_process_group()  # one that fn started itself


#: imported once by the fork server, before any rank: each rank is a fresh fork of it
PRELOADED = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
             "shardwise", "shardwise.testing"]


def process_context() -> Any:
    """A ``multiprocessing`` context whose processes are fresh forks of a server that
    imported torch and shardwise once (a start costs no import), where the platform has
    one; else spawned. What :func:`run_distributed` starts its ranks with; for a test that
    starts (and kills) a process of its own.

    Example:
        >>> ctx = process_context()
        >>> proc = ctx.Process(target=train, args=(path,)); proc.start(); proc.kill()
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def run_distributed(fn: Callable[..., Any], *args: Any, world_size: int = 2,
                    backend: str = "gloo", timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes on CPU and return each rank's result.

    The processes are forked from a server that imported torch and shardwise once
    (``multiprocessing``'s forkserver, :data:`PRELOADED`; spawned where a platform has
    none): a start costs no import, and each rank is still a new process with the caller's
    environment variables as they are at the call.

    Each process gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, ...,
    MASTER_ADDR=127.0.0.1 and a free MASTER_PORT), so ``sw.detect()`` inside ``fn`` sees a
    ``world_size``-rank job; the pipeline joins the ``backend`` group. ``fn`` and its
    results must pickle (define ``fn`` at module level). Ranks may start DataLoader workers.

    Returns:
        The results, indexed by rank.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died, or the
            whole run took longer than ``timeout`` seconds; every rank is then killed.
    """
    if backend != "gloo":
        raise ValueError(f"run_distributed() runs CPU ranks on 'gloo' (got backend={backend!r})")
    ctx = process_context()
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world_size, port, queue, environ))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, ok, value = queue.get()
                if not ok:
                    raise RankFailedError(f"rank {rank} of {world_size} failed:\n{value}")
                results[rank] = pickle.loads(value)
                continue
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise RankFailedError(f"rank {dead[0]} of {world_size} died with exit code "
                                      f"{procs[dead[0]].exitcode} before reporting a result")
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"run_distributed({fn.__name__}) timed out after {timeout} s; ranks "
                    f"{sorted(set(range(world_size)) - set(results))} did not finish")
            time.sleep(0.02)
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return [results[r] for r in range(world_size)]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


class PeakGrowth:
    """How much this process's resident memory rose above where it stood at the start of a
    ``with`` block, at its peak inside it (Linux: the kernel's high-water mark, reset at the
    start, after glibc gave freed memory back so that reusing it cannot hide a rise).
    ``bytes`` is set when the block ends.

    Example:
        >>> with PeakGrowth() as grown:
        ...     sw.export(path, bundle)
        >>> grown.bytes / model_bytes
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._start = 0

    def __enter__(self) -> PeakGrowth:
        import gc

        gc.collect()
        try:  # freed memory back to the system first: reused, it would hide the growth
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        with open("/proc/self/clear_refs", "w") as refs:  # the high-water mark back to now
            refs.write("5")
        self._start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = _status_bytes("VmHWM") - self._start


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s whole state under its own names: sharded (DTensor) entries are
    gathered (a collective: every rank calls it) and DDP's wrapper is looked through."""
    from torch.distributed.tensor import DTensor

    from shardwise._params import unwrap

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in unwrap(model).state_dict().items()}


def max_param_diff(a: nn.Module | Mapping[str, torch.Tensor],
                   b: nn.Module | Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference between two models' (or state dicts') parameters.

    Raises:
        ValueError: the two hold different names or shapes.
    """
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    if sa.keys() != sb.keys():
        raise ValueError(f"the two hold different names: {sorted(set(sa) ^ set(sb))}")
    worst = 0.0
    for key in sa:
        x, y = sa[key].detach().float().cpu(), sb[key].detach().float().cpu()
        if x.shape != y.shape:
            raise ValueError(f"{key!r} has shape {tuple(x.shape)} and {tuple(y.shape)}")
        worst = max(worst, (x - y).abs().max().item() if x.numel() else 0.0)
    return worst


class TinyMLP(nn.Module):
    """Two linear layers; ``forward(x, y)`` returns the MSE loss when ``y`` is given."""

    def __init__(self, dim: int = 8, hidden: int = 16, out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        """The prediction for ``x``, or its MSE loss against ``y`` when ``y`` is given."""
        pred = self.fc2(torch.relu(self.fc1(x)))
        if y is None:
            return pred
        return nn.functional.mse_loss(pred, y)


class TinyDecoderBlock(nn.Module):
    """A pre-norm causal self-attention + MLP block."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        # no projection biases: the key bias has no true gradient, and Adam would amplify its noise
        self.attn = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, sequence, dim) through causal self-attention and the MLP, with residuals."""
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformerLM(nn.Module):
    """A decoder-only language model; ``forward(input_ids, labels=None)`` returns a dict.

    With ``labels`` the dict holds ``loss`` (mean next-token cross-entropy) and ``logits``.
    """

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 2, layers: int = 2,
                 max_len: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(TinyDecoderBlock(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``{"logits": ...}``, with ``"loss"`` too when ``labels`` are given."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        # a linear layer on 3-D input returns a view, which FSDP2 warns about for a root output
        logits = self.head(self.norm(x)).clone()
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return out


class SyntheticTokens(Dataset[dict[str, torch.Tensor]]):
    """Sequences that count up modulo ``vocab`` from a random start: learnable, deterministic.

    Items are ``{"input_ids", "labels"}`` with labels the next tokens.
    """

    def __init__(self, size: int = 256, seq_len: int = 16, vocab: int = 32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (size, 1), generator=gen)
        seq = (starts + torch.arange(seq_len + 1)) % vocab
        self.inputs, self.labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[i], "labels": self.labels[i]}


class SyntheticRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(x, y)`` pairs with ``y = sin(x @ w)``: for :class:`TinyMLP`."""

    def __init__(self, size: int = 256, dim: int = 8, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=gen)
        w = torch.randn(dim, 1, generator=gen) / math.sqrt(dim)
        self.y = torch.sin(self.x @ w)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
