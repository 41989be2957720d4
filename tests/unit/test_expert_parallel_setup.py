# expert_parallel() without processes: finding experts modules, refusals, explain, one process.
import pytest
import torch
from _moe import OwnMoE, moe
from torch import nn

import shardwise as sw
from shardwise.parallel.moe_dispatch import expert_stacks
from shardwise.transforms.expert_parallelism import experts_modules

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind, experts", [("qwen3", 8), ("mixtral", 4), ("gptoss", 4)])
def test_the_experts_of_transformers_moe_models_are_found_as_they_are(kind, experts):
    found = experts_modules(moe(kind))
    assert len(found) == 2  # one per layer
    for name, module in found:
        assert name.endswith("experts") and module.num_experts == experts
        assert all(p.shape[0] == experts for p in expert_stacks(module).values())


def test_a_models_own_experts_are_declared_by_class_or_name():
    from _moe import OwnExperts

    model = OwnMoE()
    assert experts_modules(model) == [("experts", model.experts)]  # its forward's arguments
    assert experts_modules(model, OwnExperts) == experts_modules(model, "OwnExperts")
    assert experts_modules(model, "Linear") == [("router", model.router), ("head", model.head)]


def test_parameters_that_are_not_stacks_of_the_experts_are_refused_by_name():
    model = OwnMoE()
    model.experts.scale = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"scale \(3,\)"):
        expert_stacks(model.experts)


@pytest.mark.parametrize("kwargs, match", [
    ({"size": 0}, "'size' must be None"), ({"size": "2"}, "'size' must be None"),
    ({"experts": 3}, "'experts' must be None")])
def test_bad_arguments_are_refused_naming_them(kwargs, match):
    with pytest.raises(sw.errors.ArgumentError, match=match):
        sw.expert_parallel(**kwargs)


def test_what_it_is_not_combined_with_yet_is_refused_and_explained():
    env = sw.Env(world_size=2, local_world_size=2, rank=0)
    with pytest.raises(sw.errors.ConflictError,
                       match=r"context_parallel\(\) is not combined with expert_parallel"):
        sw.pipeline(env, sw.expert_parallel(), sw.context_parallel())
    text = sw.pipeline(env, sw.expert_parallel()).explain()
    assert "experts split over 2 data ranks" in text and "all-to-all" in text
    six = sw.Env(world_size=6, local_world_size=6, rank=0)
    text = sw.pipeline(six, sw.expert_parallel(size=2), sw.shard()).explain()
    assert "3 groups of 2 data ranks, replicas of each other" in text
    assert "beside shard() FSDP2 shards each experts module across them" in text
    # under pipeline stages the data ranks are the world over the stages: 8 ranks, pp=2
    eight = sw.Env(world_size=8, local_world_size=8, rank=0)
    staged = sw.pipeline(eight, sw.pipeline_parallel(size=2), sw.expert_parallel(size=2)).explain()
    assert "experts split over 2 data ranks" in staged and "mean over the 4 data ranks" in staged
    assert "2 groups of 2 data ranks" in staged


def test_in_one_process_it_changes_nothing():
    def run(parts):
        model = moe("qwen3")
        bundle = sw.pipeline(sw.Env(), *parts)(model, torch.optim.SGD(model.parameters(), lr=0.5))
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
        return model.state_dict()

    plain, split = run([]), run([sw.expert_parallel()])
    assert all(torch.equal(plain[k], split[k]) for k in plain)


def test_the_estimate_counts_each_ranks_experts_and_the_dispatch():
    """Beside replicate(): 1/2 of every expert stack a rank (weights, gradients, AdamW's two
    moments), and the rows each MoE layer sends and receives kept for backward (working
    bytes: a routed forward cannot run on the meta device, so activations are not known)."""
    model = moe("qwen3")
    env = sw.Env(world_size=2, local_world_size=2, rank=0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    whole = sw.estimate_memory(model, sw.pipeline(env, sw.replicate()), batch=batch)
    split = sw.estimate_memory(model, sw.pipeline(env, sw.expert_parallel()), batch=batch)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert whole.params_bytes - split.params_bytes == experts // 2 * 4
    assert whole.grads_bytes - split.grads_bytes == experts // 2 * 4
    assert whole.optimizer_bytes - split.optimizer_bytes == experts // 2 * 8
    layers, tokens, choices, width = 2, ids.numel(), 2, 32
    assert split.working_bytes - whole.working_bytes == layers * 2 * tokens * choices * width * 4
    assert "experts split over 2 ranks" in split.layout
