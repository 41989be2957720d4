# init_on_meta: rank 0 alone holds real weights; shard / replicate give every rank the same model.
import pytest
import torch

import shardwise as sw
from shardwise._params import unwrap
from shardwise.testing import TinyTransformerLM, full_state, max_param_diff, run_distributed


class WithBuffer(TinyTransformerLM):
    def __init__(self):
        super().__init__(vocab=32, dim=16, heads=2, layers=2)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)


def factory():
    torch.manual_seed(0)
    return WithBuffer()


def build_from_rank0(parts):
    model = sw.init_on_meta(factory)
    was_meta = any(p.is_meta for p in model.parameters())
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    state, out = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    return {"was_meta": was_meta, "state": full_state(bundle.model),
            "buffer": unwrap(bundle.model).scale.clone(), "loss": out.loss.item()}


@pytest.mark.parametrize("parts", [[sw.shard()], [sw.replicate()]], ids=["shard", "replicate"])
def test_weights_from_rank0_equal_a_normally_built_model(parts):
    ranks = run_distributed(build_from_rank0, parts, world_size=2)
    assert [r["was_meta"] for r in ranks] == [False, True]  # rank 1 allocated nothing
    normal = factory()
    bundle = sw.pipeline(sw.Env())(normal, torch.optim.AdamW(normal.parameters()))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    _, out = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    for rank in ranks:
        assert torch.equal(rank["buffer"], torch.arange(4.0))
        assert rank["loss"] == pytest.approx(out.loss.item(), abs=1e-6)  # same start weights
    assert max_param_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0


def save_small_llama(path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def pretrained_from_rank0(path, parts):
    import transformers.modeling_utils as modeling
    from transformers import AutoModelForCausalLM

    reads = []  # Transformers reads weight files through the safe_open it imported
    opened = modeling.safe_open
    modeling.safe_open = lambda *a, **k: reads.append(a) or opened(*a, **k)
    model = sw.init_on_meta(lambda: AutoModelForCausalLM.from_pretrained(path))
    was_meta = any(p.is_meta for p in model.parameters())
    model.train()
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.AdamW(model.parameters()))
    return {"was_meta": was_meta, "state": full_state(bundle.model), "weight_reads": len(reads)}


@pytest.mark.parametrize("parts", [[sw.shard()], [sw.replicate()]], ids=["shard", "replicate"])
def test_from_pretrained_loads_on_rank0_only_and_every_rank_gets_its_weights(tmp_path, parts):
    save_small_llama(tmp_path)
    from transformers import AutoModelForCausalLM

    ranks = run_distributed(pretrained_from_rank0, str(tmp_path), parts, world_size=2)
    assert [r["was_meta"] for r in ranks] == [False, True]  # rank 1 built it on meta
    assert ranks[0]["weight_reads"] > 0 and ranks[1]["weight_reads"] == 0
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for rank in ranks:
        assert rank["state"].keys() == expected.keys()
        assert all(torch.equal(rank["state"][k], expected[k]) for k in expected)
