# export() in one process: safetensors at a chosen dtype; a Transformers model back through from_pretrained.
import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise.testing import TinyTransformerLM


def trained(parts, steps=2):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(sw.detect().rank))
    state = bundle.init()
    for _ in range(steps):
        state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
    return bundle


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
