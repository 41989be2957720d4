# from_training_args: Transformers' TrainingArguments (or a mapping) -> pipeline + sw.fit settings.
# Its tests that start no process are in tests/unit/test_from_training_args.py.
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.configs.training_args import ARGUMENTS
from shardwise.testing import SyntheticTokens, TinyTransformerLM, full_state, run_distributed

transformers = pytest.importorskip("transformers")
DOCS = Path(__file__).parents[2] / "docs" / "training-args.md"


def test_the_docs_table_is_the_table_in_the_code():
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (.+) \|$", DOCS.read_text(), re.MULTILINE)
    assert dict(rows) == ARGUMENTS
    done = subprocess.run([sys.executable, "tools/training_args_table.py", "--check"],
                          cwd=DOCS.parents[1], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout  # the generator in tools/ agrees


def _train(output_dir, max_steps):
    """A tiny LM trained by sw.fit with the settings of a TrainingArguments mapping."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(SyntheticTokens(size=32, seq_len=8), batch_size=8 // sw.detect().world_size,
                        shuffle=True, drop_last=True)
    pipe = sw.from_training_args({
        "output_dir": output_dir, "max_steps": max_steps, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": loader.batch_size, "save_steps": 2, "logging_steps": 1,
        "disable_tqdm": True, "seed": 3, "max_grad_norm": 0.5})
    bundle = pipe(model, opt, loader)
    state = sw.fit(bundle, **pipe.fit_options)
    return state.step, full_state(bundle.model)


def test_two_ranks_from_training_args_match_one_process_and_resume(tmp_path):
    one_step, one = _train(str(tmp_path / "one"), 5)
    run_distributed(_train, str(tmp_path / "two"), 3)
    (two_step, two), _ = run_distributed(_train, str(tmp_path / "two"), 5)  # resumed at 3
    assert one_step == two_step == 5
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        ".shardwise.lock", "latest", "step_00000002", "step_00000003", "step_00000004", "step_00000005"]
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-6, rtol=1e-5)
