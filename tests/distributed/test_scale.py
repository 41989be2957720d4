# estimate_memory against FSDP2's real shards: Llama-7B at 8 and 64 simulated ranks, and 2 real ranks.
"""``benchmarks/scale.py`` run in a subprocess (its fake process groups never meet this
process's): per-rank parameter, gradient and optimizer bytes of Llama-7B under shard()
at 8 and 64 ranks and HSDP 8x8, simulated on the meta device, and of a tiny Llama on 2
gloo ranks; ``sw.estimate_memory`` must be within 10% of each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
PARTS = ("params", "grads", "optimizer")
LLAMA_7B_PARAMS = 6_738_415_616


@pytest.fixture(scope="module")
def rows():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "8", "64", "--models", "7B",
                           "--own-mesh", "--pipeline", "2", "--pipeline-model", "7B",
                           "--pipeline-ranks", "16", "--pipeline-tp", "1", "2", "--json"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def by_mesh(rows, mesh):
    return next(r for r in rows if r["mesh"] == mesh and "7B" in r["model"])


def within(estimate, held, tolerance=0.10):
    return abs(estimate / held - 1) <= tolerance


@pytest.mark.parametrize("mesh,shard_ranks", [("FSDP 8", 8), ("FSDP 64", 64), ("HSDP 8x8", 8),
                                              ("HSDP 8x8 (mesh=)", 8)])
def test_estimate_matches_simulated_shards(rows, mesh, shard_ranks):
    row = by_mesh(rows, mesh)
    held, est = row["simulated"], row["estimate"]
    # the simulation itself: every Llama-7B dim divides by 8 and 64, so a rank holds 1/n
    assert held["grads"] == LLAMA_7B_PARAMS * 4 // shard_ranks
    assert 0 < held["params"] - held["grads"] <= 1024  # the RoPE buffers, left whole
    assert held["optimizer"] == pytest.approx(2 * held["grads"], rel=1e-4)  # exp_avg, exp_avg_sq
    for part in PARTS:
        assert within(est[part], held[part]), (mesh, part, est[part], held[part])


def test_estimate_matches_two_real_ranks(rows):
    real = sorted((r for r in rows if "real" in r["model"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in real] == [0, 1]
    # vocab 251 and intermediate 171 split unevenly: rank 1 holds less, FSDP2 pads to rank 0's
    assert real[0]["simulated"]["params"] > real[1]["simulated"]["params"]
    for row in real:
        held, est = row["simulated"], row["estimate"]
        assert held["grads"] > 0 and held["optimizer"] > held["grads"]
        for part in PARTS:
            assert within(est[part], held[part]), (row["rank"], part, est[part], held[part])


def test_context_parallel_llama_8b_at_128k_tokens(rows):
    """Llama-3.1-8B's shapes under context_parallel(size=8) + shard() on 8 simulated ranks:
    the state is FSDP2's over all 8 (the cp ranks fold into the data dimension), within 10%
    of the estimate, and one 131,072-token sequence's activations per rank are the whole
    sequence's over 8 (attention counted as a fused kernel saves it, not S x S weights)."""
    row = next(r for r in rows if r.get("tokens") == 131072)
    assert row["mesh"] == "dp_shard 1 x cp 8"
    held, est = row["simulated"], row["estimate"]
    for part in PARTS:
        assert within(est[part], held[part]), (part, est[part], held[part])
    assert row["activations_rank"] == -(-row["activations_whole"] // 8)
    # far below the math kernel's weights: 32 heads x 131072^2 x 2 bytes per layer
    assert row["activations_whole"] < 32 * 131072**2 * 2
    assert "context parallel over 8" in row["layout"]


LLAMA_70B_PARAMS = 68_976_648_192


@pytest.fixture(scope="module")
def tp_rows():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for args in (["--sizes", "1024", "--models", "70B", "--tp", "8", "--no-hsdp"],
                 ["--sizes", "64", "--models", "7B", "--tp", "4"]):
        done = subprocess.run([sys.executable, str(SCRIPT), *args, "--no-real", "--context", "--json"],
                              capture_output=True, text=True, timeout=180, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def test_estimate_matches_simulated_tp8_x_dp_shard128(tp_rows):
    """Llama-70B at tp=8 x dp_shard=128 on 1024 simulated ranks: the model's own plan splits
    each layer over 8 ranks, FSDP2 shards every part over 128."""
    row = next(r for r in tp_rows if r["mesh"] == "dp_shard 128 x tp 8")
    held, est = row["simulated"], row["estimate"]
    # 1/1024 of the weights, plus FSDP2's padding of rows that 128 does not divide (vocab 4000)
    assert held["grads"] == pytest.approx(LLAMA_70B_PARAMS * 4 / 1024, rel=1e-3)
    for part in PARTS:
        assert within(est[part], held[part]), (part, est[part], held[part])


def test_estimate_matches_a_simulated_3d_mesh(tp_rows):
    """Llama-7B on 64 simulated ranks, 8 per node: dp_replicate=8 x dp_shard=2 x tp=4 (HSDP
    with tensor parallel), each rank holds 1/8 of the state."""
    row = next(r for r in tp_rows if r["mesh"] == "dp_replicate 8 x dp_shard 2 x tp 4")
    held, est = row["simulated"], row["estimate"]
    assert held["grads"] == pytest.approx(LLAMA_7B_PARAMS * 4 / 8, rel=1e-3)
    for part in PARTS:
        assert within(est[part], held[part]), (part, est[part], held[part])


def test_estimate_matches_the_busiest_pipeline_stage(rows):
    """pp=2 x dp_shard=8 on 16 simulated ranks: the rank holding the most (the head's stage)
    holds half the layers sharded 8 ways, and the estimate names and matches it."""
    row = by_mesh(rows, "dp_shard 8 x pp 2 (1F1B)")
    held, est = row["simulated"], row["estimate"]
    assert row["rank"] == 1  # the last stage: norm and head beside its layers
    assert held["grads"] < LLAMA_7B_PARAMS * 4 // 8 * 0.55  # about half the model, 1/8 each
    assert "rank 1 needs the most" in row["layout"]
    for part in PARTS:
        assert within(est[part], held[part], 0.01), (part, est[part], held[part])



def test_estimate_matches_the_busiest_stage_split_by_tensor_parallel(rows):
    """pp=2 x tp=2 x dp_shard=4 on 16 simulated ranks: the busiest stage's first
    tensor-parallel rank holds about half the layers, split 2 ways and sharded 4 ways; the
    estimate matches it."""
    row = by_mesh(rows, "dp_shard 4 x pp 2 x tp 2 (1F1B)")
    held, est = row["simulated"], row["estimate"]
    assert row["rank"] == 2  # pipeline rank 1 (the head's stage), tp rank 0
    staged = by_mesh(rows, "dp_shard 8 x pp 2 (1F1B)")["simulated"]
    # split 2 ways and sharded 4 instead of sharded 8: the same bytes, the norms aside
    assert held["grads"] == pytest.approx(staged["grads"], rel=1e-3)
    for part in PARTS:
        assert within(est[part], held[part], 0.01), (part, est[part], held[part])


QWEN3_235B_PARAMS = 235_093_634_560


def test_estimate_matches_a_simulated_qwen3_235b_under_expert_parallel():
    """Qwen3-235B-A22B's shapes on 256 simulated ranks under expert_parallel(size=16) x
    shard() (+ pipeline_parallel(size=4)): every expert stack 1/16 a rank, sharded again by
    FSDP2 across the replica groups (8 experts over 16 replicas: by rows), the rest sharded
    over the data ranks; the estimate equals what the busiest rank holds (within 0.1%), and
    without stages a rank holds 1/256 of the model."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "--no-real", "--context",
                           "--pipeline", "--experts", "16", "--experts-pp", "1", "4", "--json"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["mesh"] for r in rows] == ["dp_shard 256; ep 16 x 16 replicas",
                                         "dp_shard 64 x pp 4; ep 16 x 4 replicas"]
    for row in rows:
        held, est = row["simulated"], row["estimate"]
        for part in PARTS:
            assert within(est[part], held[part], 0.001), (row["mesh"], part, est[part],
                                                           held[part])
    flat = rows[0]["simulated"]
    assert flat["grads"] == pytest.approx(QWEN3_235B_PARAMS * 4 / 256, rel=1e-3)
    assert "sharded again across 4 replicas" in rows[1]["layout"]
