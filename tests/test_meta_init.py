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
