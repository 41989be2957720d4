# expert_parallel(): experts split over 2 gloo ranks, tokens by all-to-all, equal to one process.
import functools
import os

import pytest
import torch
from _moe import moe, token_batches
from safetensors.torch import load_file

import shardwise as sw
from shardwise.parallel.mesh import data_share
from shardwise.testing import full_state, run_distributed

pytest.importorskip("transformers")


def trained(kind, parts, steps, optimizer="sgd", root=None, resume=None, own_seeds=False):
    """``kind`` under ``parts`` after ``steps`` of :func:`token_batches` on the global batch
    of 4 rows (each rank its rows), from ``resume`` if given; saved and exported to
    ``root`` if given: the whole weights (and the local shape of each split parameter).
    ``own_seeds``: each rank builds the model from a seed of its own (rank 0's is 0)."""
    model = moe(kind, seed=sw.detect().rank if own_seeds else 0)
    env = sw.detect()
    made = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    bundle = sw.pipeline(env, *parts)(model, made)
    state = sw.load(resume, bundle) if resume is not None else bundle.init()
    shares, index, _ = data_share(env, bundle.plan.mesh)  # a pipeline group shares its batch
    share = 4 // shares
    for ids in token_batches()[state.step:steps]:
        mine = ids[index * share:(index + 1) * share]
        state, _ = bundle.step(state, {"input_ids": mine, "labels": mine})
    if root is not None:
        sw.save(root, bundle, state)
        sw.export(os.path.join(root, "hf"), bundle)
    held = {name: tuple(p.to_local().shape) for name, p in bundle.engine.unwrap(
        bundle.model).named_parameters() if hasattr(p, "to_local")}
    return full_state(bundle.model), held


@functools.cache
def one_process(kind, steps, optimizer="sgd"):
    """:func:`trained` in this process, without a layout (computed once per session)."""
    return trained(kind, [], steps, optimizer)[0]


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "gptoss", "own"])
def test_experts_split_over_two_ranks_train_as_one_process(kind):
    """Three steps of SGD in fp32 on the global batch: each rank holds half of every
    expert stack, and the weights equal one process's within 1e-5."""
    parts = [sw.expert_parallel(experts="OwnExperts" if kind == "own" else None)]
    one = one_process(kind, 3)
    ranks = run_distributed(trained, kind, parts, 3, world_size=2, timeout=120)
    base = moe(kind).state_dict()
    assert max((base[k] - one[k]).abs().max().item() for k in one) > 1e-2  # it trained
    for weights, held in ranks:
        assert held and all(shape[0] * 2 == one[name].shape[0] for name, shape in held.items())
        assert weights.keys() == one.keys()
        gap = max((weights[k] - one[k]).abs().max().item() for k in one)
        assert gap < 1e-5, gap


def test_an_expert_parallel_checkpoint_resumes_at_any_size_and_exports_whole(tmp_path):
    """AdamW, 2 steps on 2 ranks, saved: the export's experts are whole and equal to the
    trained ones; resumed on 2 ranks and in one process, the third step lands where an
    uninterrupted run's does (the same run on 2 ranks exactly, one process within 1e-5)."""
    parts = [sw.expert_parallel()]
    root = str(tmp_path / "ep")
    (saved, _), _ = run_distributed(trained, "qwen3", parts, 2, "adamw", root, world_size=2,
                                    timeout=120)
    step = sorted(p for p in os.listdir(root) if p.startswith("step_"))[-1]
    exported = load_file(tmp_path / "ep" / "hf" / "model.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    straight = run_distributed(trained, "qwen3", parts, 3, "adamw", world_size=2, timeout=120)
    again = run_distributed(trained, "qwen3", parts, 3, "adamw", None,
                            os.path.join(root, step), world_size=2, timeout=120)
    for (weights, _), (uninterrupted, _) in zip(again, straight, strict=True):
        assert all(torch.equal(weights[k], uninterrupted[k]) for k in weights)
    one = one_process("qwen3", 3, "adamw")
    alone, _ = trained("qwen3", [], 3, "adamw", None, os.path.join(root, step))
    assert max((alone[k] - one[k]).abs().max().item() for k in one) < 1e-5


def clipped(parts):
    """Qwen3-MoE, SGD, gradients clipped to 0.05 (every step clips), two micro-batches
    per step: the weights and each step's norm before clipping."""
    model = moe("qwen3")
    env = sw.detect()
    parts = [*parts, sw.clip_gradients(0.05), sw.accumulate_gradients(2)]
    bundle = sw.pipeline(env, *parts)(model, torch.optim.SGD(model.parameters(), lr=0.5))
    state, norms = bundle.init(), []
    share = 8 // env.world_size
    for ids in token_batches(4, rows=8):
        mine = ids[env.rank * share:(env.rank + 1) * share]
        for half in (mine[:share // 2], mine[share // 2:]):
            state, out = bundle.step(state, {"input_ids": half, "labels": half})
            if out.grad_norm is not None:
                norms.append(float(out.grad_norm))
    return full_state(bundle.model), norms


@pytest.mark.parametrize("ranks,parts", [(2, [sw.expert_parallel()]),
                                         (4, [sw.expert_parallel(size=2), sw.shard()])],
                         ids=["ep2", "ep2_x_shard_on_4"])
def test_clipping_and_accumulation_see_the_whole_gradient(ranks, parts):
    """The norm is taken over the expert stacks' shards and the other weights together
    (torch's clip_grad_norm_ cannot stack both kinds) and equals one process's; so do the
    weights after accumulated, clipped steps. On 4 ranks the stacks live on the experts'
    2-D mesh (FSDP2 across the replicas, skipping its reduction until a window's end) and
    the other weights on FSDP2's 4 ranks."""
    one, norms = clipped([])
    for weights, split_norms in run_distributed(clipped, parts, world_size=ranks,
                                                timeout=300):
        assert split_norms == pytest.approx(norms, rel=1e-5) and len(norms) == 4
        assert max((weights[k] - one[k]).abs().max().item() for k in one) < 1e-5


def test_beside_shard_the_other_weights_are_sharded_and_a_checkpoint_resumes_alone(tmp_path):
    """expert_parallel() x shard(): FSDP2 shards every weight but the expert stacks (the
    dispatch's), SGD steps equal one process within 1e-5; a checkpoint saved there resumes
    in one process and its export holds the experts whole."""
    parts = [sw.expert_parallel(), sw.shard()]
    one = one_process("qwen3", 3)
    ranks = run_distributed(trained, "qwen3", parts, 3, world_size=2, timeout=120)
    for weights, held in ranks:
        assert max((weights[k] - one[k]).abs().max().item() for k in one) < 1e-5
        experts = {n: shape[0] for n, shape in held.items() if ".experts." in n}
        assert experts and all(count == 4 for count in experts.values())  # 8 experts, 2 ranks
        assert held["model.embed_tokens.weight"][0] == 32  # FSDP2's half of 64 rows
    root = str(tmp_path / "ep")
    (saved, _), _ = run_distributed(trained, "qwen3", parts, 2, "sgd", root, world_size=2,
                                    timeout=120)
    step = sorted(p for p in os.listdir(root) if p.startswith("step_"))[-1]
    exported = load_file(tmp_path / "ep" / "hf" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    alone, _ = trained("qwen3", [], 3, "sgd", None, os.path.join(root, step))
    assert max((alone[k] - one[k]).abs().max().item() for k in one) < 1e-5


@pytest.mark.parametrize("extra", [sw.checkpoint_activations(), sw.compile()],
                         ids=["checkpoint_activations", "compile"])
def test_it_composes_with_checkpointing_and_compile(extra):
    """Recomputation in backward runs the dispatch again (every rank recomputes the same
    layers in the same order, so the all-to-alls pair up); compiled blocks call it as
    Python. Both equal one process within 1e-5."""
    one = one_process("qwen3", 3)
    for weights, _ in run_distributed(trained, "qwen3", [sw.expert_parallel(), extra], 3,
                                      world_size=2, timeout=300):
        assert max((weights[k] - one[k]).abs().max().item() for k in one) < 1e-5


def test_experts_that_get_no_token_still_step_as_in_one_process():
    """Every token picks experts 0 and 1, both on rank 0: rank 1's experts get no row. In
    one process their rows of the stacks get a zero gradient, so AdamW still decays them
    and counts the step; on rank 1 they must too (a None gradient would skip them)."""
    parts = [sw.expert_parallel(experts="OwnExperts")]
    one = one_process("own_skewed", 3, "adamw")
    base = moe("own_skewed").state_dict()
    assert not torch.equal(one["experts.up"][2:], base["experts.up"][2:])  # decayed
    for weights, _ in run_distributed(trained, "own_skewed", parts, 3, "adamw", world_size=2,
                                      timeout=120):
        assert max((weights[k] - one[k]).abs().max().item() for k in one) < 1e-5


@pytest.mark.parametrize("kind,other,held_rows", [
    ("qwen3", "replicate", 4), ("qwen3", "shard", 2), ("qwen3_two", "shard", 1)],
    ids=["replicate", "shard", "shard_by_rows"])
def test_two_expert_groups_of_two_ranks_train_as_one_process(tmp_path, kind, other, held_rows):
    """ep=2 on 4 ranks: two groups of two ranks, replicas of each other, each rank half of
    every expert stack (under shard() FSDP2 shards that half again across the replicas: by
    expert, a quarter each; with 2 experts, one a rank, by each expert's rows); the other
    weights replicated or sharded by FSDP2 over all 4. Three SGD steps on the global batch
    (each rank its row) equal one process within 1e-5; the checkpoint saved there loads in
    one process with those weights, and (sharded) at ep=4 on the same 4 ranks."""
    parts = [sw.expert_parallel(size=2), getattr(sw, other)()]
    one = one_process(kind, 3)
    root = str(tmp_path / "ep")
    ranks = run_distributed(trained, kind, parts, 3, "sgd", root, world_size=4, timeout=300)
    for weights, held in ranks:
        experts = {n: shape for n, shape in held.items() if ".experts." in n}
        assert experts and all(shape[0] == held_rows for shape in experts.values()), experts
        if kind == "qwen3_two":  # one expert a rank, its rows halved across the replicas
            assert all(shape[1] * 2 == one[n].shape[1] for n, shape in experts.items()), experts
        gap = max((weights[k] - one[k]).abs().max().item() for k in one)
        assert gap < 1e-5, gap
    step = sorted(p for p in os.listdir(root) if p.startswith("step_"))[-1]
    alone, _ = trained(kind, [], 3, "sgd", None, os.path.join(root, step))
    assert all(torch.equal(alone[k], ranks[0][0][k]) for k in one)
    if (kind, other) == ("qwen3", "shard"):  # and at another expert-parallel size: 4 ranks
        wider = run_distributed(trained, kind, [sw.expert_parallel(), sw.shard()], 3, "sgd",
                                None, os.path.join(root, step), world_size=4, timeout=300)
        assert all(torch.equal(alone[k], wider[0][0][k]) for k in one)


def test_pipeline_stages_times_expert_groups_on_four_ranks_train_as_one_process(tmp_path):
    """pp=2 x ep=2 on 4 ranks: each stage's two data ranks split that stage's experts (ranks
    0 and 2 hold stage 0, 1 and 3 stage 1), every microbatch's MoE layers dispatch inside
    the stage's group, the other weights sharded over the two (the pipeline's default);
    three SGD steps equal one process within 1e-5; the checkpoint saved there loads in one
    process with those weights, and the export holds every expert whole."""
    parts = [sw.pipeline_parallel(size=2), sw.expert_parallel()]
    one = one_process("qwen3", 3)
    seen, root = set(), str(tmp_path / "pp_ep")
    ranks = run_distributed(trained, "qwen3", parts, 3, "sgd", root, world_size=4, timeout=300)
    step = sorted(p for p in os.listdir(root) if p.startswith("step_"))[-1]
    alone, _ = trained("qwen3", [], 3, "sgd", None, os.path.join(root, step))
    exported = load_file(tmp_path / "pp_ep" / "hf" / "model.safetensors")
    assert exported.keys() == alone.keys()
    assert all(torch.equal(exported[k], v) for k, v in alone.items())
    for weights, held in ranks:
        assert all(torch.equal(alone[k], v) for k, v in weights.items())
        experts = {n: shape[0] for n, shape in held.items() if ".experts." in n}
        assert experts and all(count == 4 for count in experts.values())  # 8 experts, ep=2
        gap = max((weights[k] - one[k]).abs().max().item() for k in weights)  # its stage's
        assert gap < 1e-5, gap
        seen |= set(weights)
    assert seen == set(one)


def test_tensor_parallel_times_expert_groups_on_four_ranks_train_as_one_process():
    """tp=2 x ep=2 on 4 ranks: tensor parallelism splits attention (Qwen3-MoE's own plan,
    its q/k norms whole with their gradient summed across the group) and leaves the experts
    to the dispatch; each tensor-parallel rank's data ranks (0 and 2, 1 and 3) split the
    experts; the other weights sharded over the data ranks. Three SGD steps equal one
    process within 1e-5."""
    parts = [sw.tensor_parallel(size=2), sw.expert_parallel(), sw.shard()]
    one = one_process("qwen3", 3)
    for weights, held in run_distributed(trained, "qwen3", parts, 3, "sgd", None, None, True,
                                         world_size=4, timeout=300):
        experts = {n: shape[0] for n, shape in held.items() if ".experts." in n}
        assert experts and all(count == 4 for count in experts.values())  # 8 experts, ep=2
        gap = max((weights[k] - one[k]).abs().max().item() for k in one)
        assert gap < 1e-5, gap


def test_a_pipeline_stage_without_experts_does_not_stop_the_others():
    """Qwen3-MoE with a dense first layer under pp=2 x ep=2 on 4 ranks: stage 0 holds no
    experts module (its ranks agree with the others instead of refusing alone, which left
    them waiting in the experts' mesh), stage 1 splits its experts; equal to one process."""
    parts = [sw.pipeline_parallel(size=2), sw.expert_parallel()]
    one = one_process("qwen3_dense_first", 3)
    held_experts = []
    for weights, held in run_distributed(trained, "qwen3_dense_first", parts, 3, world_size=4,
                                         timeout=300):
        held_experts.append(any(".experts." in n for n in held))
        assert max((weights[k] - one[k]).abs().max().item() for k in weights) < 1e-5
    assert held_experts == [False, True, False, True]  # stage 0: ranks 0 and 2
