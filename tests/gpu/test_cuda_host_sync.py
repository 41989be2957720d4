# GPU tier: what only a CUDA device can show (run by benchmarks/gpu_check.sh on a GPU machine).
"""Tests behind the ``gpu`` marker: skipped where there is no CUDA device, selected with
``pytest -m gpu`` (``benchmarks/gpu_check.sh`` runs them on a GPU machine)."""

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA (benchmarks/gpu_check.sh)")]


def token_batches(n, seed=0):
    data = SyntheticTokens(size=4 * n, seq_len=8, vocab=64, seed=seed)
    return list(DataLoader(data, batch_size=4))


def lm_and_adamw():
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=64, dim=16, heads=2, layers=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_default_step_does_not_synchronise_with_the_gpu():
    import warnings

    model, opt = lm_and_adamw()
    env = sw.Env(device=torch.device("cuda", 0), precisions=("fp32", "bf16"))
    bundle = sw.pipeline(env)(model, opt)
    batches = [{k: v.cuda() for k, v in b.items()} for b in token_batches(6)]
    state, _ = bundle.step(bundle.init(), batches[0])  # the first step creates state
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in batches[1:]:
                state, _ = bundle.step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [] and bundle.check(state).step == 6
