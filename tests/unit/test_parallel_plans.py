# Tensor, context and pipeline parallelism without ranks: plans and arguments refused, sizes from the layout.
import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import ArgumentError, ConflictError, DataError

from _parallel import Tokens, heads8, llama
from conftest import ONE

pytest.importorskip("transformers")


# -- refused plans (the plan is checked before anything is split) --------------------------

def refused(model, **kwargs):
    transform = sw.tensor_parallel(**kwargs)
    with pytest.raises(ConflictError) as caught:
        transform.resolved(model, transform.size or 2)
    return str(caught.value)


def test_unknown_module_is_refused_naming_both():
    text = refused(llama(), plan={"model.layers.*.attn.q": "colwise"})
    assert "model.layers.*.attn.q" in text and "LlamaForCausalLM" in text


def test_indivisible_layer_is_refused_naming_both():
    text = refused(llama(), plan={"model.layers.*.mlp.up_proj": "colwise"}, size=3)
    assert "up_proj.weight" in text and "64" in text and "3" in text


def test_indivisible_heads_are_refused():
    text = refused(llama(heads=2, kv_heads=1), size=2)
    assert "num_key_value_heads=1" in text


def test_tied_weights_are_refused_however_the_plan_splits_them():
    text = refused(llama(tie=True))
    assert "tied" in text and "lm_head" in text and "embed_tokens" in text
    # kept whole on both sides, the tie would still come apart (each module's parameters
    # are registered anew)
    text = refused(llama(tie=True), plan={"model.layers.*.mlp.up_proj": "colwise",
                                          "model.layers.*.mlp.down_proj": "rowwise"})
    assert "tie_word_embeddings=False" in text


def test_a_models_own_plan_with_an_unmapped_style_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model._tp_plan = {"0": "local_colwise"}
    text = refused(model)
    assert "'local_colwise'" in text and "Sequential" in text and "colwise" in text


def test_heads_are_checked_only_when_attention_is_split():
    mlp_only = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    chosen = sw.tensor_parallel(plan=mlp_only).resolved(llama(heads=2, kv_heads=1), 2)
    assert len(chosen) == 4


def test_the_default_distribution_beside_tensor_parallel_is_shard():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down(self.up(x).relu())

    model = torch.nn.Sequential(Block(), Block())
    plan = {"*.up": "colwise", "*.down": "rowwise"}
    for memory in (None, 2**30):  # device memory unknown, or known
        four = sw.Env(world_size=4, local_world_size=4, device_memory_bytes=memory)
        pipe = sw.pipeline(four, sw.tensor_parallel(plan, size=2)).resolve(model)
        chosen = [t.factory_name for t in pipe.transforms if t.stage == sw.transforms.Stage.DISTRIBUTION]
        assert chosen == ["shard"], chosen
        assert "DDP runs neither pipeline stages nor DTensor layers, so shard()" in pipe.explain()
    two = sw.Env(world_size=2, local_world_size=2)
    spans = sw.pipeline(two, sw.tensor_parallel(plan, size=2)).resolve(model)
    assert not [t for t in spans.transforms if t.stage == sw.transforms.Stage.DISTRIBUTION]


def test_model_without_plan_is_refused():
    text = refused(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert "Sequential" in text and "plan=" in text


def test_style_and_module_kind_are_checked():
    with pytest.raises(sw.errors.ArgumentError, match="'diagonal'"):
        sw.tensor_parallel(plan={"x": "diagonal"})
    with pytest.raises(sw.errors.ArgumentError, match="size"):
        sw.tensor_parallel(size=0)
    text = refused(llama(), plan={"model.norm": "colwise"})
    assert "LlamaRMSNorm" in text and "nn.Linear" in text


def test_replicate_beside_tensor_parallel_is_refused():
    with pytest.raises(ConflictError, match="replicate"):
        sw.pipeline(ONE, sw.tensor_parallel(), sw.replicate())


def test_one_process_is_a_no_op():
    model = llama()
    bundle = sw.pipeline(ONE, sw.tensor_parallel())(model, torch.optim.SGD(model.parameters()))
    assert bundle.engine.name == "one process" and bundle.mesh is None


def test_a_size_that_does_not_divide_the_world_is_refused_when_built():
    four = sw.Env(world_size=4, local_world_size=4)
    with pytest.raises(sw.errors.EnvError, match=r"tensor_parallel\(size=3\) must divide the world size 4"):
        sw.pipeline(four, sw.tensor_parallel(size=3))
    six = sw.Env(world_size=6, local_world_size=3, num_nodes=2)
    with pytest.raises(sw.errors.EnvError, match=r"size=None: the 3 ranks of a node"):
        sw.pipeline(sw.Env(world_size=4, local_world_size=3, num_nodes=1), sw.tensor_parallel())
    assert "tp=3" in sw.pipeline(six, sw.tensor_parallel()).explain()
    # the default size is the ranks of one node
    assert "tp=4" in sw.pipeline(four, sw.tensor_parallel()).explain()


def test_a_users_sampler_over_other_ranks_than_the_data_ranks_is_refused():
    from torch.utils.data import DistributedSampler

    from shardwise.data import shard_loader
    from shardwise.parallel.mesh import layout

    rank1 = sw.Env(world_size=4, local_world_size=4, rank=1, local_rank=1)
    per_rank = DataLoader(Tokens(), batch_size=2,
                          sampler=DistributedSampler(Tokens(), num_replicas=4, rank=1))
    with pytest.raises(DataError, match=r"num_replicas=4 .*data ranks are 2 .*num_replicas=2, rank=0"):
        shard_loader(per_rank, rank1, mesh=layout(rank1, tp=2))
    per_share = DataLoader(Tokens(), batch_size=2,
                           sampler=DistributedSampler(Tokens(), num_replicas=2, rank=0))
    assert shard_loader(per_share, rank1, mesh=layout(rank1, tp=2)) is per_share


# -- context_parallel() and pipeline_parallel(): their arguments ----------------------------

def test_context_parallel_arguments_are_checked():
    with pytest.raises(sw.errors.ArgumentError, match="'size'"):
        sw.context_parallel(size=0)
    with pytest.raises(sw.errors.ArgumentError, match="ring"):
        sw.context_parallel(method="ring")
    with pytest.raises(ConflictError, match="deepspeed"):
        sw.pipeline(sw.context_parallel(), sw.deepspeed({"zero_optimization": {"stage": 2}}))


def test_arguments_are_checked():
    with pytest.raises(ArgumentError, match="'schedule' must be one of GPipe, 1F1B"):
        sw.pipeline_parallel(schedule="Zigzag")
    with pytest.raises(ArgumentError, match="runs one stage per rank"):
        sw.pipeline_parallel(schedule="1F1B", stages_per_rank=2)
    with pytest.raises(ArgumentError, match="exactly 2 stages per rank"):
        sw.pipeline_parallel(schedule="DualPipeV", stages_per_rank=3)
    with pytest.raises(ArgumentError, match="'microbatches' must be None or an integer"):
        sw.pipeline_parallel(microbatches=0)
    with pytest.raises(ConflictError, match="use shard.. for the data ranks"):
        sw.pipeline(sw.pipeline_parallel(), sw.replicate())
    with pytest.raises(ConflictError, match="not combined with pipeline_parallel yet"):
        sw.pipeline(sw.pipeline_parallel(), sw.local_sgd(4))
    with pytest.raises(ConflictError, match="use shard.reshard_after_forward=False."):
        sw.pipeline(sw.pipeline_parallel(schedule="DualPipeV"), sw.shard())


# -- sizes left at None come from the one mesh layout, in explain() and the estimate ----------

EIGHT = sw.Env(world_size=8, local_world_size=8)


def test_a_transform_at_size_none_is_sized_from_the_one_layout_in_explain():
    """8 ranks, context_parallel() and pipeline_parallel() left at size=None beside
    tensor_parallel(size=2): each is sized from the layout (4), as the mesh line says (they
    said 8 ranks, from a layout of themselves alone)."""
    cp = sw.pipeline(EIGHT, sw.context_parallel(), sw.tensor_parallel(size=2), sw.shard())
    text = cp.explain()
    assert "Ulysses over the mesh's cp dimension (4 ranks)" in text
    assert "mesh: dp_shard=1 x cp=4 x tp=2 over 8 ranks" in text
    pp = sw.pipeline(EIGHT, sw.pipeline_parallel(), sw.tensor_parallel(size=2)).explain()
    assert "pp dimension (4 ranks, 4 stages, 1 per rank)" in pp and "8 stages" not in pp
    assert "mesh: dp_shard=1 x pp=4 x tp=2 over 8 ranks" in pp
    # the memory estimate reads the same layout: 4 stages over 4 pipeline ranks
    estimate = sw.estimate_memory(heads8(), sw.pipeline(EIGHT, sw.pipeline_parallel(),
                                                        sw.tensor_parallel(size=2)))
    assert "pipeline parallel over 4 ranks" in estimate.layout
    # shard() beside a pipeline or a context-parallel split shards over the data ranks of
    # the mesh (it said the world's 8, from a layout of itself alone)
    stages = sw.pipeline(EIGHT, sw.pipeline_parallel(size=2), sw.shard()).explain()
    assert "each part sharded over 4 ranks (the mesh's dp_shard; dp_shard=4 x pp=2)" in stages
    context = sw.pipeline(EIGHT, sw.context_parallel(size=2), sw.shard()).explain()
    assert "sharded over 8 ranks (the mesh's dp_shard with cp folded in" in context
