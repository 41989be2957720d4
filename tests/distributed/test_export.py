# export(): full, clean safetensors from sharded and replicated runs; Transformers round trip.
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


def test_export_casts_to_a_dtype(tmp_path):
    bundle = trained([])
    sw.export(tmp_path, bundle, dtype=torch.bfloat16)
    weights = load_file(tmp_path / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert not (tmp_path / "config.json").exists()


def test_a_transformers_model_round_trips_through_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.max_new_tokens, model.generation_config.do_sample = 7, False
    pipe = sw.pipeline(sw.Env(), sw.checkpoint_activations(sw.by_class("LlamaDecoderLayer")))
    bundle = pipe(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 64, (2, 12))
    state = bundle.init()
    for _ in range(2):
        state, out = bundle.step(state, {"input_ids": ids, "labels": ids})
    sw.export(tmp_path, bundle)
    assert (tmp_path / "config.json").is_file()
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    assert (tmp_path / "generation_config.json").is_file()
    assert again.generation_config.max_new_tokens == 7
    prompt = ids[:1, :4]
    assert torch.equal(again.generate(prompt), model.eval().generate(prompt))
