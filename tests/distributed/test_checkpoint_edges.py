# Checkpoint edges a hostile review found: each was a lost, mixed or half-restored state.
# Its tests that start no process are in tests/unit/test_checkpoint_edge_cases.py.
import os

import torch

import shardwise as sw
from shardwise.testing import run_distributed

from conftest import build_lm, train_for


def load_with_a_different_view(root):
    """Rank 1 would find another checkpoint on its own (a writer publishing meanwhile)."""
    import shardwise.checkpoint.restore as restore

    bundle = build_lm([], accumulate=1)
    if torch.distributed.get_rank() == 1:
        restore.candidates = lambda root: iter([root / "step_00000001"])
    return sw.load(root, bundle).step


def test_every_rank_loads_the_checkpoint_rank_0_chose(tmp_path):
    bundle = build_lm([], accumulate=1)
    state = bundle.init()
    for _ in range(2):
        state, _ = train_for(bundle, state, 1)
        sw.save(tmp_path, bundle, state)
    assert run_distributed(load_with_a_different_view, tmp_path) == [2, 2]
    assert os.path.isdir(tmp_path / "step_00000001")
