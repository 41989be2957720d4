# The library's own cost per step: shardwise vs a hand-written loop on a model too small to matter.
"""Per-step overhead of ``bundle.step`` over a hand-written torch loop, one CPU process.

The model is a single 4->1 linear layer, so compute is negligible and the difference is
what shardwise adds per step. Rounds interleave the two loops; medians are reported.
Target: <= 20 microseconds per step over hand-written.

    python benchmarks/overhead.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shardwise as sw


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = (torch.randn(8, 4), torch.randn(8, 1))

    hand_model, hand_opt = make()

    def hand(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = mse(hand_model, batch)
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / n

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

    hand(args.steps), ours(args.steps)  # warm-up
    hands, oursl = [], []
    for _ in range(args.rounds):
        hands.append(hand(args.steps))
        oursl.append(ours(args.steps))
    h, s = statistics.median(hands) * 1e6, statistics.median(oursl) * 1e6
    print(f"hand-written  {h:8.1f} us/step (median of {args.rounds} rounds x {args.steps} steps)")
    print(f"shardwise     {s:8.1f} us/step")
    print(f"overhead      {s - h:8.1f} us/step   ratio {s / h:.3f}   target <= 20 us")


if __name__ == "__main__":
    main()
