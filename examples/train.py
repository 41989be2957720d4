# A tiny transformer language model trained with the default shardwise pipeline.
"""Run with ``python examples/train.py`` or ``torchrun --nproc_per_node=2 examples/train.py``.

The same script trains in one process or many: ``sw.detect()`` reads the launcher's
variables and the default pipeline replicates the model when there are several ranks.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = TinyTransformerLM(vocab=32, dim=32, heads=2, layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = DataLoader(SyntheticTokens(size=512, seq_len=16), batch_size=args.batch_size,
                        shuffle=True, drop_last=True)

    # resolve() makes the default choices for this model (replicate or shard, by memory)
    pipe = sw.pipeline(sw.detect(), sw.clip_gradients(1.0)).resolve(model, optimizer,
                                                                     loader=loader)
    bundle = pipe(model, optimizer, loader)
    env = bundle.env
    if env.is_main:
        print(pipe.explain(), flush=True)

    state = bundle.init()
    for _ in range(args.epochs):
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            if env.is_main and state.step % args.log_every == 0:
                print(f"epoch {state.epoch} step {state.step:4d}  loss {out.loss.item():.4f}  "
                      f"grad_norm {out.grad_norm.item() if out.grad_norm is not None else 0:.3f}",
                      flush=True)
    if env.is_main:
        print(f"done: {state.step} optimizer steps on {env.world_size} process(es)")


if __name__ == "__main__":
    main()
