# The library's own cost per step: shardwise vs a hand-written loop on a model too small to matter.
"""Per-step overhead of ``bundle.step`` over a hand-written torch loop, one CPU process.

The model is a single 4->1 linear layer, so compute is negligible and the difference is
what shardwise adds per step. Rounds interleave the loops; medians are reported. shardwise
runs torch's fused SGD kernel (it switches an SGD built without ``foreach``/``fused``, so a
non-finite step is skipped on the device without a host sync), so the overhead is taken
against a hand-written loop with ``fused=True``; the hand-written default (for-loop) SGD is
printed beside it. Target: <= 20 microseconds per step over hand-written (same kernel).

    python benchmarks/overhead.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import shardwise as sw


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def make(**kernel: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, **kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = (torch.randn(8, 4), torch.randn(8, 1))

    def hand_loop(fused: bool) -> Callable[[int], float]:
        hand_model, hand_opt = make(fused=True) if fused else make()

        def hand(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                loss = mse(hand_model, batch)
                loss.backward()
                hand_opt.step()
                hand_opt.zero_grad(set_to_none=True)
            return (time.perf_counter() - start) / n
        return hand

    hand, hand_default = hand_loop(True), hand_loop(False)

    model, opt = make()
    bundle = sw.pipeline(sw.detect())(model, opt, loss_fn=mse)
    state = bundle.init()

    def ours(n: int) -> float:
        nonlocal state
        step = bundle.step
        start = time.perf_counter()
        for _ in range(n):
            state, _ = step(state, batch)
        return (time.perf_counter() - start) / n

    hand(args.steps), hand_default(args.steps), ours(args.steps)  # warm-up
    hands, defaults, oursl = [], [], []
    for _ in range(args.rounds):
        hands.append(hand(args.steps))
        defaults.append(hand_default(args.steps))
        oursl.append(ours(args.steps))
    h, d, s = (statistics.median(x) * 1e6 for x in (hands, defaults, oursl))
    print(f"hand-written, fused SGD    {h:8.1f} us/step (median of {args.rounds} rounds x "
          f"{args.steps} steps)")
    print(f"hand-written, default SGD  {d:8.1f} us/step")
    print(f"shardwise                  {s:8.1f} us/step")
    print(f"overhead                   {s - h:8.1f} us/step   ratio {s / h:.3f}   target <= 20 us "
          f"(same kernel); {s - d:+.1f} us against the default SGD")
    kernels()


def kernels(tensors: int = 150, steps: int = 10) -> None:
    """AdamW's step on ~10M parameters with each of torch's implementations: the default
    (for-loop on a CPU), the fused kernel shardwise switches to, and foreach."""
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    numel = sum(p.numel() for p in params) / 1e6
    for name, kernel in (("default", {}), ("fused=True", {"fused": True}),
                         ("foreach=True", {"foreach": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kernel)
        opt.step()
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        took = (time.perf_counter() - start) / steps * 1e3
        print(f"AdamW step, {numel:.1f}M parameters, {name:<13} {took:8.2f} ms")

if __name__ == "__main__":
    main()
