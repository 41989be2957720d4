# A short training run for the sw.compile tests, for one process and for ranks alike.
"""Shared by tests/unit/test_regional_compile.py and tests/distributed/test_compile.py;
their ``eager`` fixture (these runs uncompiled) is in tests/conftest.py."""

import torch
import torch._dynamo
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM, full_state

STEPS = 3


def train(parts, batch_size=4, layers=2):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=32, heads=2, layers=layers)
    loader = DataLoader(SyntheticTokens(size=64, seq_len=8), batch_size=batch_size, shuffle=True)
    pipe = sw.pipeline(sw.detect(), *parts, sw.checkpoint_activations(),
                       sw.accumulate_gradients(2), sw.clip_gradients(0.5))
    bundle = pipe(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    state = bundle.init()
    for batch in bundle.loader:
        state, _ = bundle.step(state, batch)
        if state.step == STEPS:
            break
    bundle.check(state)
    return {"params": full_state(bundle.model), "graphs": counters["stats"]["unique_graphs"],
            "names": sorted(n for n, _ in bundle.model.named_parameters()),
            "explain": pipe.explain()}
