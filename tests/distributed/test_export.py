# export(): full, clean safetensors from sharded and replicated runs; Transformers round trip.
# Its tests that start no process are in tests/unit/test_export_safetensors.py.
import os

import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise.testing import TinyTransformerLM, full_state, run_distributed


def trained(parts, steps=2):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(sw.detect().rank))
    state = bundle.init()
    for _ in range(steps):
        state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
    return bundle


def export_from(root, parts):
    bundle = trained(parts)
    path = sw.export(os.path.join(root, "out"), bundle)
    return full_state(bundle.model), str(path)


@pytest.mark.parametrize("parts", [[sw.shard(), sw.checkpoint_activations()], [sw.replicate()]],
                         ids=["shard+checkpointing", "replicate"])
def test_export_from_two_ranks_loads_strictly_into_the_plain_model(tmp_path, parts):
    (expected, path), _ = run_distributed(export_from, str(tmp_path), parts, world_size=2)
    weights = load_file(os.path.join(path, "model.safetensors"))
    plain = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    plain.load_state_dict(weights, strict=True)
    assert all(torch.equal(plain.state_dict()[k], expected[k]) for k in expected)
    assert not any(("module." in k or "_fsdp" in k or "_checkpoint" in k) for k in weights)
