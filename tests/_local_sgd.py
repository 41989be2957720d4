# Each rank's batches and a weight snapshot for the local_sgd tests.
"""Shared by tests/unit/test_local_sgd_and_ulysses.py and tests/distributed/test_local_sgd.py."""

import torch

EVERY, STEPS = 3, 6


def batches(rank, steps=STEPS):
    """Each rank's own batches: (x, y) pairs drawn from a seed per rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(steps)]


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
