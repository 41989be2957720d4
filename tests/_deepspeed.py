# Whether DeepSpeed imports here, and the small model, loader and config of the sw.deepspeed tests.
"""Shared by tests/unit/test_deepspeed_pipeline.py and tests/distributed/test_deepspeed.py.
Importing it sets ``DS_ACCELERATOR=cpu`` (unless set) before trying ``import deepspeed``."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from shardwise.testing import SyntheticTokens, TinyTransformerLM

os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed  # noqa: F401
    MISSING = None
except Exception as exc:  # ImportError, or its accelerator failing to set up
    MISSING = f"deepspeed cannot be imported here ({type(exc).__name__}: {exc})"

needs_deepspeed = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FP32 = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "steps_per_print": 10**9}


def _model():
    torch.manual_seed(0)
    return TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)


def _loader(batch_size):
    return DataLoader(SyntheticTokens(size=32, seq_len=8), batch_size=batch_size, shuffle=True)
