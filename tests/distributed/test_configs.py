# from_config / from_ddp_args: Accelerate YAML, DeepSpeed JSON, Transformers fsdp_config, DDP args.
# Its tests that start no process are in tests/unit/test_from_config.py.
import torch

import shardwise as sw
from shardwise.testing import SyntheticTokens, TinyTransformerLM, run_distributed

from conftest import SEED


def train_from_seed():
    config = {**SEED, "mixed_precision": "no", "fsdp_config": {
        **SEED["fsdp_config"], "fsdp_transformer_layer_cls_to_wrap": "TinyDecoderBlock",
        "fsdp_cpu_ram_efficient_loading": False}}
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    loader = torch.utils.data.DataLoader(SyntheticTokens(size=64, seq_len=8), batch_size=4,
                                         shuffle=True)
    bundle = sw.from_config(config)(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    state, losses = bundle.init(), []
    for batch in bundle.loader:
        state, out = bundle.step(state, batch)
        losses.append(out.loss.item())
    return type(bundle.model).__name__, losses


def test_the_seed_config_trains_sharded_on_two_ranks():
    for model_type, losses in run_distributed(train_from_seed, world_size=2):
        assert model_type == "FSDPTinyTransformerLM"
        assert losses[-1] < losses[0]


def train_root_only():
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    bundle = sw.pipeline(sw.detect(), sw.shard(sw.policies.root_only()))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    state, out = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    return type(bundle.model).__name__, type(bundle.model.layers[0]).__name__, out.stepped


def test_root_only_sharding_trains_on_two_ranks():
    assert run_distributed(train_root_only, world_size=2) == [
        ("FSDPTinyTransformerLM", "TinyDecoderBlock", True)] * 2
