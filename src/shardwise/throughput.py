# Throughput: samples and tokens in a batch, the model's training FLOPs per token, the device's peak.
"""What ``sw.fit`` logs as ``train/samples_per_s``, ``train/tokens_per_s`` and ``train/mfu``.

- A batch's samples are the first dimension of its first tensor; its tokens are the
  elements of its ``input_ids`` (every position, padding included, as torchtitan counts),
  None when it has none.
- Training FLOPs per token are torchtitan's estimate: ``6 * N`` for the forward and backward
  of the ``N`` parameters outside embeddings, plus ``12 * layers * hidden * sequence`` for
  attention when the model has a Transformers-style ``config`` (``num_hidden_layers``,
  ``hidden_size``). Activation recomputation is not counted, as MFU's definition says.
- The peak is the dense bf16 (or TF32 for fp32) tensor-core rate of the device, from
  :data:`PEAK_FLOPS` by the CUDA device's name; pass ``peak_flops=`` to ``sw.fit`` for a
  device not in the table (a CPU has no entry: no MFU is logged there unless given).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shardwise.env import Env
from shardwise.metrics import reduce

__all__ = ["PEAK_FLOPS", "Meter", "batch_counts", "flops_per_token", "peak_flops"]

#: dense tensor-core FLOP/s per device, (bf16/fp16, tf32), by a substring of the CUDA
#: device's name, most specific first (vendor data sheets)
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.4e12, 494.7e12),
    "H100 PCIe": (756.0e12, 378.0e12),
    "H100": (989.4e12, 494.7e12),
    "GH200": (989.4e12, 494.7e12),
    "A100": (312.0e12, 156.0e12),
    "L40S": (362.1e12, 183.0e12),
    "L4": (121.0e12, 60.0e12),
    "A10G": (70.0e12, 35.0e12),
    "A10": (125.0e12, 62.5e12),
    "RTX 4090": (165.2e12, 82.6e12),
    "MI300X": (1307.4e12, 653.7e12),
}


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch: the first dimension of its first tensor, and the
    elements of its ``input_ids`` (None without them)."""
    tokens = None
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        tokens = int(batch["input_ids"].numel())
    leaves, _ = tree_flatten(batch)
    first = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.ndim), None)
    return (int(first.shape[0]) if first is not None else 1), tokens


def flops_per_token(model: nn.Module, sequence: int) -> int:
    """Training FLOPs (forward and backward) per token of a sequence of ``sequence`` tokens:
    ``6 * N`` (``N``: parameters outside embeddings, each counted once) plus attention's
    ``12 * layers * hidden * sequence`` when the model's ``config`` names them."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    count = 0
    for param in model.parameters():
        if id(param) in seen or id(param) in embeddings:
            continue
        seen.add(id(param))
        count += param.numel()
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    attention = 12 * layers * hidden * sequence if isinstance(layers, int) and \
        isinstance(hidden, int) else 0
    return 6 * count + attention


def peak_flops(env: Env, precision: str) -> float | None:
    """The device's dense peak FLOP/s at ``precision`` (bf16/fp16, else TF32), or None when
    it is not in :data:`PEAK_FLOPS` (a CPU, an unknown accelerator)."""
    if env.device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(env.device)
    for key, (half, tf32) in PEAK_FLOPS.items():
        if key in name:
            return half if precision in ("bf16", "fp16") else tf32
    return None


class Meter:
    """Samples and tokens the ranks trained on since the last reading, over the time spent in
    training steps (checkpoints and evaluations inside :meth:`paused` are left out).

    Args:
        model: the model whose FLOPs per token MFU counts (unwrapped).
        env: where the run is.
        copies: ranks that read each batch (a tensor-parallel group), counted once.
        peak: the device's peak FLOP/s (None: no MFU).
    """

    def __init__(self, model: nn.Module, env: Env, copies: int, peak: float | None) -> None:
        self.model, self.env, self.copies, self.peak = model, env, copies, peak
        self._per_token: dict[int, int] = {}
        self._reset()

    def _reset(self) -> None:
        self.start, self.away, self.samples, self.tokens = time.perf_counter(), 0.0, 0, 0
        self.counted = True  # every micro-batch had input_ids

    def add(self, samples: int, tokens: int | None) -> None:
        """Count one micro-batch of this rank."""
        self.samples += samples
        if tokens is None:
            self.counted = False
        else:
            self.tokens += tokens

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is not training time (a checkpoint, an evaluation)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.away += time.perf_counter() - began

    def rates(self) -> dict[str, float]:
        """``samples_per_s``, ``tokens_per_s`` and ``mfu`` (a fraction) over all ranks since
        the last reading (tokens and MFU only when every micro-batch had ``input_ids``; MFU
        only with a peak). A collective: every rank calls it, after a host sync."""
        device = self.env.device if self.env.device.type != "cpu" else torch.device("cpu")
        local = torch.tensor([self.samples, self.tokens, float(self.counted)],
                             dtype=torch.float64, device=device)
        total = reduce(local, op="sum").tolist()
        # the job's time is its slowest rank's: every rank reports the same rates
        mine = torch.tensor(time.perf_counter() - self.start - self.away, dtype=torch.float64,
                            device=device)
        elapsed = max(float(reduce(mine, op="max")), 1e-9)
        ranks = self.env.world_size if self.env.is_distributed else 1
        samples, tokens = total[0] / self.copies, total[1] / self.copies
        out = {"samples_per_s": samples / elapsed}
        if total[2] == ranks and tokens > 0:
            out["tokens_per_s"] = tokens / elapsed
            if self.peak is not None:
                sequence = max(1, round(tokens / samples))
                if sequence not in self._per_token:
                    self._per_token[sequence] = flops_per_token(self.model, sequence)
                out["mfu"] = out["tokens_per_s"] * self._per_token[sequence] / (self.peak * ranks)
        self._reset()
        return out
