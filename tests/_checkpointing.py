# Models, data and comparisons of the save, load and export tests, one process and ranks alike.
"""Each helper here is used by a test module of tests/unit and one of tests/distributed (the
section lines name them). Only pure helpers live here: whatever starts processes stays in
the test modules, where ``tests/_tiers.py`` sees it."""

import os

import torch
from torch.utils.data import DataLoader, Dataset

import shardwise as sw
from shardwise.testing import TinyMLP, TinyTransformerLM

from conftest import build_lm, train_for

# -- comparing weights (test_background_save, test_async_save, test_checkpoint_transactions) ----

def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- an optimizer's state on this rank (test_save_load, test_checkpoint) ---------------------

def _optimizer_tensors(optimizer):
    local = getattr(optimizer, "optim", optimizer)  # ZeRO-1: this rank's share
    out = {}
    for i, values in enumerate(local.state.values()):
        for key, value in values.items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{i}.{key}"] = value.detach().clone()
    return out


# -- two checkpoints in one root (test_checkpoint_manifest, test_checkpoint_transactions) ----

def saved_two(root):
    bundle = build_lm([], accumulate=1)
    state, _ = train_for(bundle, bundle.init(), 1)
    first = sw.save(root, bundle, state)
    state, _ = train_for(bundle, state, 1)
    second = sw.save(root, bundle, state)
    return bundle, state, first, second


# -- a forged pickle (test_save_load, test_deepspeed) ----------------------------------------

class Payload:
    """Runs a command when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# -- the data position (test_checkpoint_load, test_checkpoint_loading) -----------------------

class Ids(Dataset):
    """Sample i is (i repeated 8 times, 0): its id can be read back from any batch."""

    def __init__(self, size):
        self.size = size
        self.fetched = 0

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        self.fetched += 1
        return torch.full((8,), float(i)), torch.zeros(1)


def ids_bundle(batch_size, size=64, drop_last=False):
    torch.manual_seed(0)
    model = TinyMLP()
    loader = DataLoader(Ids(size), batch_size=batch_size, shuffle=True, drop_last=drop_last)
    return sw.pipeline(sw.detect())(model, torch.optim.SGD(model.parameters(), lr=0.01), loader)


# -- a trained bundle to export (test_export_safetensors, test_export) -----------------------

def trained(parts, steps=2):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(sw.detect().rank))
    state = bundle.init()
    for _ in range(steps):
        state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
    return bundle
