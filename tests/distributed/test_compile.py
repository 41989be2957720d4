# sw.compile(): regional torch.compile, one graph per distinct block, equal to eager under every distribution.
# Its tests that start no process are in tests/unit/test_regional_compile.py.
"""Compiled training must compute what eager training computes: one process, and 2 gloo ranks
under replicate, shard and tensor_parallel, with activation checkpointing, accumulation and
clipping. The distributed runs use the ``aot_eager`` backend (dynamo and AOTAutograd, no
C++ code generation: seconds, not minutes on 2 cores); one single-process run (tests/unit)
uses ``inductor``."""


import shardwise as sw
from shardwise.testing import max_param_diff, run_distributed

from _compiling import train


def two_ranks():
    parts = {"replicate": [sw.replicate()], "shard": [sw.shard()]}
    runs = {name: train([*p, sw.compile(backend="aot_eager")], batch_size=2)
            for name, p in parts.items()}
    bf16 = [sw.shard(), sw.mixed_precision("bf16")]
    runs["bf16_eager"] = train(bf16, batch_size=2)
    runs["bf16_compiled"] = train([*bf16, sw.compile(backend="aot_eager")], batch_size=2)
    return runs


def test_two_ranks_compiled_under_replicate_and_shard_equal_eager(eager):
    for rank in run_distributed(two_ranks, world_size=2, timeout=400):
        for name in ("replicate", "shard"):
            assert rank[name]["graphs"] == 1, name
            assert max_param_diff(rank[name]["params"], eager[4]["params"]) <= 1e-5, name
        # bf16 (FSDP2's parameter casting) compiled: what the same pipeline computes eagerly
        assert max_param_diff(rank["bf16_compiled"]["params"], rank["bf16_eager"]["params"]) <= 1e-5
