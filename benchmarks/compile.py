# Regional vs whole-model torch.compile on a tiny Llama: cold start, graphs, step time, parity; one run.
"""What ``sw.compile()`` buys and costs on this CPU, side by side.

Each case runs in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
a new folder, FX graph cache off), so the first step pays the whole cold compile:

- ``LlamaForCausalLM`` (hidden 128, 4/2 heads, vocab 512) with 4 and 8 layers; eager,
  ``sw.compile()`` (regional, inductor) and ``sw.compile(regional=False)`` (whole model);
- first step (s: compile included), unique graphs compiled (dynamo's counter), median
  ms/step of 10 steps after 3, and the largest parameter difference from eager after the
  13 steps (fp32, AdamW);
- then on 2 gloo ranks, 4 layers, regional inductor under ``replicate()`` and ``shard()``
  against eager in one process on the same global batches.

    OMP_NUM_THREADS=1 python benchmarks/compile.py [--layers 4 8] [--no-ranks]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import shardwise as sw

BATCH, SEQ, STEPS, WARMUP = 4, 64, 10, 3


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=SEQ))


def run(kind: str, layers: int, parts: list[sw.Transform], global_batch: int = BATCH) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    model = llama(layers)
    extra = {"eager": [], "regional": [sw.compile()], "whole": [sw.compile(regional=False)]}[kind]
    env = sw.detect()
    bundle = sw.pipeline(env, *parts, *extra)(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 512, (global_batch, SEQ), generator=torch.Generator().manual_seed(0))
    share = global_batch // env.world_size
    mine = ids[env.rank * share:(env.rank + 1) * share]
    batch = {"input_ids": mine, "labels": mine}
    state, times = bundle.init(), []
    for _ in range(1 + WARMUP + STEPS):
        start = time.perf_counter()
        state, _ = bundle.step(state, batch)
        state = bundle.check(state)
        times.append(time.perf_counter() - start)
    from shardwise.testing import full_state

    return {"first_s": times[0], "ms": statistics.median(times[1 + WARMUP:]) * 1000,
            "graphs": counters["stats"]["unique_graphs"], "params": full_state(bundle.model)}


def case(kind: str, layers: int) -> None:
    """One process, one case; prints JSON (without the parameters) and saves them."""
    out = run(kind, layers, [])
    torch.save(out.pop("params"), os.environ["SW_PARAMS_OUT"])
    print(json.dumps(out))


def fresh(kind: str, layers: int, folder: str) -> dict[str, Any]:
    params = os.path.join(folder, f"{kind}-{layers}.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SW_PARAMS_OUT": params,
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=folder),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    done = subprocess.run([sys.executable, __file__, "--case", kind, str(layers)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{kind} x {layers} layers failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["params"] = torch.load(params)
    return row


def ranks_rows(folder: str, eager: dict[str, torch.Tensor]) -> list[str]:
    from shardwise.testing import max_param_diff, run_distributed

    os.environ.update(TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=folder),
                      TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    rank0 = run_distributed(_ranks, world_size=2, timeout=3600)[0]
    return [f"| 2 ranks, {name}, regional | 4 | {r['first_s']:.1f} | - | {r['ms']:.1f} | "
            f"{max_param_diff(r['params'], eager):.1e} |" for name, r in rank0.items()]


def _ranks() -> dict[str, Any]:
    rows = {name: run("regional", 4, parts) for name, parts in
            (("replicate", [sw.replicate()]), ("shard", [sw.shard()]))}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--no-ranks", action="store_true", help="skip the 2-rank parity rows")
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        case(args.case[0], int(args.case[1]))
        return
    from shardwise.testing import max_param_diff

    began = time.perf_counter()
    lines = ["| case | layers | first step s | unique graphs | ms/step | max diff vs eager |",
             "|---|---|---|---|---|---|"]
    eager4: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as folder:
        for layers in args.layers:
            rows = {kind: fresh(kind, layers, folder) for kind in ("eager", "regional", "whole")}
            if layers == 4:
                eager4 = rows["eager"]["params"]
            for kind, row in rows.items():
                diff = max_param_diff(row["params"], rows["eager"]["params"])
                lines.append(f"| {kind} | {layers} | {row['first_s']:.1f} | {row['graphs']} | "
                             f"{row['ms']:.1f} | {diff:.1e} |")
        if not args.no_ranks and eager4:
            lines += ranks_rows(folder, eager4)
    print("\n".join(lines))
    print(f"\n{time.perf_counter() - began:.0f} s; torch {torch.__version__}, backend inductor, "
          f"batch {BATCH} x {SEQ} tokens (2 ranks: {BATCH // 2} each), AdamW, fp32")


if __name__ == "__main__":
    main()
