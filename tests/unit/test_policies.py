# Policies and the sharding family's checks that need no process group.
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.errors import ConflictError, PolicyError
from shardwise.policies import candidate_blocks, select
from shardwise.testing import TinyDecoderBlock, TinyMLP, TinyTransformerLM

ONE = sw.Env()


def names(policy, model):
    return [n for n, _ in select(policy, model, user="test")]


def test_auto_picks_the_repeated_blocks_of_module_lists():
    model = TinyTransformerLM(layers=3)
    assert names(sw.auto(), model) == ["layers.0", "layers.1", "layers.2"]
    assert candidate_blocks(model) == ["TinyDecoderBlock"]


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(3))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.enc = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.dec = nn.ModuleList(MoELayer() for _ in range(2))


def test_auto_picks_the_outermost_layer_stacks_only():
    model = EncoderDecoder()
    assert names(sw.auto(), model) == ["enc.0", "enc.1", "dec.0", "dec.1"]  # not the experts,
    assert candidate_blocks(model) == ["Linear", "MoELayer"]  # nor the unrelated body Linear


def test_auto_prefers_transformers_no_split_modules():
    model = TinyTransformerLM(layers=2)
    model._no_split_modules = ["MultiheadAttention"]
    assert names(sw.auto(), model) == ["layers.0.attn", "layers.1.attn"]


def test_by_class_by_name_or_type_and_callables():
    model = TinyTransformerLM(layers=2)
    assert names(sw.by_class("TinyDecoderBlock"), model) == ["layers.0", "layers.1"]
    assert names(sw.by_class(nn.LayerNorm), model)[-1] == "norm"
    assert names(lambda name, m: name == "head", model) == ["head"]
    assert repr(sw.by_class("A", nn.Linear)) == "by_class('A', Linear)"


def test_selection_is_deepest_first():
    model = TinyTransformerLM(layers=1)
    chosen = names(sw.by_class("TinyDecoderBlock", "MultiheadAttention"), model)
    assert chosen == ["layers.0.attn", "layers.0"]


def test_by_size_keeps_outermost_modules():
    model = TinyTransformerLM(dim=16, layers=2)
    block_params = sum(p.numel() for p in model.layers[0].parameters())
    chosen = names(sw.by_size(block_params), model)
    assert chosen == ["layers.0", "layers.1"]


def test_a_policy_that_selects_nothing_lists_candidates():
    with pytest.raises(PolicyError) as info:
        select(sw.by_class("LlamaDecoderLayer"), TinyTransformerLM(), user="shard()")
    msg = str(info.value)
    assert "by_class('LlamaDecoderLayer') selects no submodule of TinyTransformerLM" in msg
    assert "['TinyDecoderBlock']" in msg
    with pytest.raises(PolicyError, match="none .the model has no nn.ModuleList"):
        select(sw.auto(), TinyMLP(), user="shard()")


@pytest.mark.parametrize("make, message", [
    (lambda: sw.by_class(), "needs at least one class"),
    (lambda: sw.by_class(3), "takes class names or classes (got 3)"),
    (lambda: sw.by_size(0), "'min_params' must be an integer >= 1 (got 0)"),
    (lambda: sw.shard(reshard_after_forward="no"), "'reshard_after_forward' must be a bool"),
    (lambda: sw.offload(cpu=1), "'cpu' must be a bool (got 1)"),
    (lambda: sw.shard("TinyDecoderBlock"), "write by_class('TinyDecoderBlock')"),
    (lambda: sw.checkpoint_activations(3), "a policy must be auto(), by_class(...)"),
])
def test_factories_refuse_bad_options(make, message):
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert message in str(info.value)


def test_offload_without_shard_says_to_add_shard():
    with pytest.raises(ConflictError, match=r"offload\(cpu=True\) needs shard\(\).*Add sw.shard\(\)"):
        sw.pipeline(ONE, sw.offload())
    sw.pipeline(ONE, sw.offload(cpu=False))  # the explicit no-op is fine


def test_shard_optimizer_with_shard_is_refused():
    with pytest.raises(ConflictError, match="shard\\(\\) already shards optimizer state"):
        sw.pipeline(ONE, sw.shard(), sw.shard_optimizer())


def test_shard_and_replicate_together_are_refused():
    with pytest.raises(ConflictError, match="both distribute the model"):
        sw.pipeline(ONE, sw.shard(), sw.replicate())


def test_one_process_shard_is_a_no_op_and_says_so():
    pipe = sw.pipeline(ONE, sw.shard(), sw.offload())
    assert "one process: nothing to shard" in pipe.explain()
    model = TinyTransformerLM()
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert bundle.model is model


def saved_bytes_and_block_calls(checkpointed):
    torch.manual_seed(0)
    model = TinyTransformerLM(dim=32, layers=2)
    if checkpointed:
        model = sw.checkpoint_activations(sw.by_class(TinyDecoderBlock))(
            sw.Bundle(model, env=ONE)).model
    calls = []
    for block in model.layers:
        block.mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    ids = torch.randint(0, 32, (4, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids)["loss"]
    forward_calls = len(calls)
    loss.backward()
    return sum(total), forward_calls, len(calls), [n for n, _ in model.named_parameters()]


def test_checkpoint_activations_recomputes_blocks_and_saves_less():
    plain_bytes, plain_fwd, plain_all, plain_names = saved_bytes_and_block_calls(False)
    ckpt_bytes, ckpt_fwd, ckpt_all, ckpt_names = saved_bytes_and_block_calls(True)
    assert (plain_fwd, plain_all) == (2, 2)
    assert (ckpt_fwd, ckpt_all) == (2, 4)  # each block's forward runs again in backward
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
    assert ckpt_names == plain_names  # no wrapper prefixes


def test_checkpointed_training_equals_plain_training():
    results = []
    for parts in ([], [sw.checkpoint_activations()]):
        torch.manual_seed(0)
        model = TinyTransformerLM()
        bundle = sw.pipeline(ONE, *parts)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = bundle.init()
        ids = torch.randint(0, 32, (4, 12))
        for _ in range(3):
            state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
        results.append(model.state_dict())
    assert sw.testing.max_param_diff(*results) <= 1e-6


def test_transforms_applied_by_hand_out_of_order_are_refused():
    bundle = sw.Bundle(TinyTransformerLM(), env=ONE)
    bundle = sw.shard()(bundle)
    with pytest.raises(ConflictError) as info:
        sw.mixed_precision("bf16")(bundle)
    msg = str(info.value)
    assert "mixed_precision(precision='bf16') (settings) cannot be applied after shard(" in msg
    assert ("settings, pipeline_parallel, expert_parallel, tensor_parallel, surgery, compile, "
            "distribution, fault_tolerance, placement, optimizer, data") in msg


def test_estimate_counts_buffers_frozen_parameters_and_accumulated_gradients():
    model = TinyTransformerLM(dim=16, layers=2)
    model.register_buffer("table", torch.zeros(1000))
    for p in model.parameters():
        p.requires_grad_(False)
    model.head.weight.requires_grad_(True)
    est = sw.estimate_memory(model)
    all_params = sum(p.numel() for p in model.parameters()) * 4
    assert est.params_bytes == all_params + 4000
    assert est.grads_bytes == model.head.weight.numel() * 4
    assert est.optimizer_bytes == model.head.weight.numel() * 8 + 4  # AdamW: two moments, step
    two = sw.Env(world_size=2, local_world_size=2)
    full = TinyTransformerLM(dim=16, layers=2)
    grads = [sw.estimate_memory(full, parts, two).grads_bytes for parts in (
        [sw.shard()], [sw.shard(), sw.accumulate_gradients(4)],
        [sw.shard(sync_each_batch=True), sw.accumulate_gradients(4)])]
    unsharded = sum(p.numel() for p in full.parameters()) * 4
    assert grads[1] == unsharded and grads[0] == grads[2] < 0.6 * unsharded


def test_offload_frees_device_bytes_only_off_the_host():
    model = TinyTransformerLM(dim=16, layers=2)
    for device, freed in (("cpu", False), ("meta", True)):
        env = sw.Env(world_size=2, local_world_size=2, device=device)
        with_offload = sw.estimate_memory(model, [sw.shard(), sw.offload()], env)
        without = sw.estimate_memory(model, [sw.shard()], env)
        assert (with_offload.total_bytes < without.total_bytes) == freed


def test_checkpointing_twice_is_refused():
    bundle = sw.checkpoint_activations()(sw.Bundle(TinyTransformerLM(), env=ONE))
    with pytest.raises(ConflictError, match="was applied to this bundle already"):
        sw.checkpoint_activations()(bundle)
    with pytest.raises(ConflictError, match="layers.0 .TinyDecoderBlock. is checkpointed already"):
        sw.checkpoint_activations()(sw.Bundle(bundle.model, env=ONE))
