# Tokens/s, MFU and peak memory of a ~1B Llama on one GPU: hand-written, shardwise variants, Accelerate.
"""One GPU, a Llama of about 1.1B parameters (hidden 2048, 16 layers, vocabulary 32000),
bf16 autocast, torch's fused AdamW, sequences of 2048 tokens, batch 1. Each row runs in a
fresh process (its own peak memory), ``--warmup`` steps then ``--steps`` timed ones between
two ``cuda.synchronize()``:

- ``hand-written``: ``model.cuda()``, ``AdamW(fused=True)``, ``torch.autocast("cuda", bf16)``,
  ``loss.backward()``, ``step()``, ``zero_grad()``;
- ``shardwise``: ``sw.pipeline(sw.detect())`` (bf16 is its CUDA default), ``bundle.step``;
- ``shardwise+compile``: with ``sw.compile()`` (regional);
- ``shardwise+checkpointing``: with ``sw.checkpoint_activations()``;
- ``accelerate``: ``Accelerator(mixed_precision="bf16")``, its prepared model and optimizer.

Prints tokens/s, MFU (``shardwise.throughput``'s FLOPs per token over the device's peak) and
peak memory per row, and each row's ratio to hand-written. Goal: shardwise within 2% of
hand-written and not below Accelerate.

    python benchmarks/gpu_throughput.py                # on a GPU machine
    python benchmarks/gpu_throughput.py --tiny --device cpu --steps 2 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS = ("hand-written", "shardwise", "shardwise+compile", "shardwise+checkpointing", "accelerate")
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
           num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)


def row(name: str, tiny: bool, device: str, steps: int, warmup: int) -> dict[str, float]:
    """One row in this process: tokens/s, MFU (None without a known peak), peak memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardwise as sw
    from shardwise.throughput import flops_per_token, peak_flops

    config = TINY if tiny else BIG
    seq = 32 if tiny else 2048
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    ids = torch.randint(0, config["vocab_size"], (1, seq))
    batch = {"input_ids": ids, "labels": ids}
    cuda = device == "cuda"
    fused = {"fused": True} if cuda else {}
    if name == "hand-written":
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
        on_device = {k: v.to(device) for k, v in batch.items()}

        def step() -> None:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(**on_device).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif name == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="bf16", cpu=not cuda)
        prepared, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=1e-5, **fused))
        on_device = {k: v.to(accelerator.device) for k, v in batch.items()}

        def step() -> None:
            accelerator.backward(prepared(**on_device).loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        extra = {"shardwise": [], "shardwise+compile": [sw.compile()],
                 "shardwise+checkpointing": [sw.checkpoint_activations(
                     sw.by_class("LlamaDecoderLayer"))]}[name]
        env = sw.detect()
        precision = [] if cuda else [sw.mixed_precision("bf16")]  # CUDA's default is bf16
        bundle = sw.pipeline(env, *precision, *extra)(
            model, torch.optim.AdamW(model.parameters(), lr=1e-5, **fused))
        on_device = sw.to_device(batch, env.device)
        state = [bundle.init()]

        def step() -> None:
            state[0], _ = bundle.step(state[0], on_device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    tokens = steps * seq / elapsed
    peak = peak_flops(sw.detect(), "bf16")
    mfu = tokens * flops_per_token(model, seq) / peak if peak else None
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"tokens_per_s": tokens, "mfu": mfu, "peak_gib": memory,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (a smoke run)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child process's one row
    args = parser.parse_args()
    if args.row:
        print(json.dumps(row(args.row, args.tiny, args.device, args.steps, args.warmup)))
        return
    results = {}
    for name in args.rows:
        cmd = [sys.executable, __file__, "--row", name, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + \
            (["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                                  "OMP_NUM_THREADS", "1")})
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}")
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    if not results:
        sys.exit(1)
    first = next(iter(results.values()))
    adam = "fused AdamW" if args.device == "cuda" else "AdamW"
    print(f"Llama {first['params'] / 1e9:.2f}B parameters, bf16, {adam}, "
          f"{'tiny' if args.tiny else 'sequence 2048'}, batch 1, {args.device}, "
          f"{args.steps} timed steps after {args.warmup}:")
    base = results.get("hand-written")
    for name, r in results.items():
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "    -"
        memory = f"{r['peak_gib']:6.1f} GiB" if r["peak_gib"] is not None else "      -"
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:6.3f}x" if base else ""
        print(f"  {name:<24} {r['tokens_per_s']:10.1f} tokens/s  MFU {mfu}  peak {memory}  "
              f"{ratio} hand-written")
    sys.exit(0 if len(results) == len(args.rows) else 1)


if __name__ == "__main__":
    main()
