# GPU tier: what only a CUDA device can show (run by benchmarks/gpu_check.sh on a GPU machine).
"""Tests behind the ``gpu`` marker: skipped where there is no CUDA device, selected with
``pytest -m gpu`` (``benchmarks/gpu_check.sh`` runs them on a GPU machine)."""

import pytest
import torch

import shardwise as sw

from conftest import lm_and_adamw, token_batches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA (benchmarks/gpu_check.sh)")]


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
