# A tiny Llama trained with the launcher's FSDP2 config: `shardwise launch` or `accelerate launch`.
"""Train a small randomly initialised ``LlamaForCausalLM`` from Accelerate's FSDP2 config.

The script names no distribution, precision or wrapping: the launcher's config decides.
Both launchers build the same pipeline (FSDP2 on ``LlamaDecoderLayer`` blocks, bf16)::

    shardwise launch --config_file examples/fsdp2.yaml examples/llama_fsdp.py
    accelerate launch --config_file examples/fsdp2.yaml examples/llama_fsdp.py

``--summary F`` writes the pipeline, the losses and the final weights' norms as JSON (rank 0).
Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw


class Tokens(Dataset):
    """Counting sequences (start, start + k, start + 2k, ... mod vocab): learnable, so the loss
    falls. The labels are the inputs (causal LM)."""

    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (size, 1), generator=gen)
        stride = torch.randint(1, 4, (size, 1), generator=gen)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--summary", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(Tokens(256, 32, config.vocab_size), batch_size=4, shuffle=True)

    pipe = sw.pipeline(sw.detect())             # the launcher's config: FSDP2, bf16, Llama blocks
    bundle = pipe(model, optimizer, loader)
    if bundle.env.is_main:
        print(pipe.explain())
    state, losses = bundle.init(), []
    while state.step < args.steps:
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            losses.append(float(sw.reduce(out.loss.detach().float(), "mean")))
            if state.step >= args.steps:
                break
    state = bundle.check(state)  # a loop ended mid-epoch: read the last step's late check
    norms = {name: float(p.detach().float().norm() ** 2) for name, p in
             bundle.model.named_parameters()}  # this rank's shards; summed over ranks below
    total = torch.tensor([norms[n] for n in sorted(norms)], dtype=torch.float64)
    total = sw.reduce(total, "sum")
    if bundle.env.is_main:
        print(f"step {state.step}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if args.summary:
            with open(args.summary, "w") as file:
                json.dump({"transforms": [repr(t) for t in pipe.transforms], "losses": losses,
                           "norms": dict(zip(sorted(norms), total.tolist(), strict=True))}, file, indent=1)


if __name__ == "__main__":
    main()
