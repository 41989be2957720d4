# pipeline_parallel() on real gloo ranks: every torch schedule on 2 ranks against one process.
# Its tests that start no process are in tests/unit/test_parallel_plans.py.
"""A tiny Transformers Llama (4 layers) with per-sample prompt masks and right padding, trained
4 optimizer steps (accumulation 2, clipping) with its layers cut into pipeline stages, must
match one process on the same global batches under every schedule; a checkpoint goes from
pp=2 to one process and back; a non-finite gradient on one stage stops every stage."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise as sw
from shardwise.errors import ArgumentError, ConflictError, NonFiniteError
from shardwise.testing import full_state, max_param_diff, run_distributed

from conftest import Prompts as SharedPrompts
from conftest import llama

pytest.importorskip("transformers")

GLOBAL_BATCH = 4
STEPS = 4  # optimizer steps
ACCUMULATE = 2
SEQ = 8
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")


class Prompts(SharedPrompts):
    """Prompts of 1..3 tokens and right padding of 0..2 over 8 tokens."""

    def __init__(self, size=32):
        super().__init__(size=size, seq=SEQ, prompt=4, pad=3)


def token_sum(model, batch):
    """One process's loss: the summed loss of the batch and its labelled tokens."""
    out = model(**batch, num_items_in_batch=1)
    return out.loss, (batch["labels"][:, 1:] != -100).sum()


def built(parts, model=None, data_ranks=1):
    model = model or llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = DataLoader(Prompts(), batch_size=GLOBAL_BATCH // data_ranks, shuffle=True)
    pipe = sw.pipeline(sw.detect(), *parts, sw.accumulate_gradients(ACCUMULATE),
                       sw.clip_gradients(0.5))
    staged = any(isinstance(p, sw.transforms.PipelineParallel) for p in parts)
    return pipe, pipe(model, opt, loader, loss_fn=None if staged else token_sum,
                      eval_loader=DataLoader(Prompts(size=12), batch_size=GLOBAL_BATCH))


def steps(bundle, state, until, save_at=None, root=None):
    """Train until optimizer step ``until`` (saving at step ``save_at``); the clipping norms
    and reported losses."""
    norms, losses = [], []
    for batch in bundle.loader:
        state, out = bundle.step(state, batch)
        losses.append(out.loss.item())
        if out.grad_norm is not None:
            norms.append(out.grad_norm.item())
        if state.step == save_at and not state.window_batches:
            sw.save(root, bundle, state)
        if state.step == until:
            break
    return bundle.check(state), norms, losses


def train(parts, save_at=None, root=None, data_ranks=1):
    pipe, bundle = built(parts, data_ranks=data_ranks)
    state, norms, losses = steps(bundle, bundle.init(), STEPS, save_at, root)
    out = {"params": full_state(bundle.model), "norms": norms, "losses": losses,
           "explain": pipe.explain()}
    if data_ranks > 1 or not bundle.stages:  # 11 samples over 2 data ranks: one repeated
        out["padded"] = sw.evaluate(bundle, DataLoader(Prompts(size=11), batch_size=2))
        out["gathered"] = gathered(bundle, DataLoader(Prompts(size=11), batch_size=2))
    batch = next(iter(DataLoader(Prompts(), batch_size=GLOBAL_BATCH)))
    out.update(evaluated=sw.evaluate(bundle), predicted=bundle.predict(batch))
    return out


def gathered(bundle, loader):
    """predict's logits of every sample, gathered for metrics (the repeated one dropped), in
    one order (sorted by their tokens)."""
    loader = bundle.distribute(loader)
    logits, ids = [], []
    for batch in loader:
        got, inputs = sw.gather_for_metrics((bundle.predict(batch).logits, batch["input_ids"]),
                                            loader)
        logits.append(got)
        ids.append(inputs)
    ids = torch.cat(ids)
    return torch.cat(logits)[sorted(range(len(ids)), key=lambda i: ids[i].tolist())]


def whole(runs, name):
    """Each rank's stages' parameters together (the model's own names)."""
    merged = {}
    for rank in runs:
        merged.update(rank[name]["params"])
    return merged


def schedules():
    return {name: train([sw.pipeline_parallel(schedule=name)]) for name in SCHEDULES}


@pytest.fixture(scope="module")
def reference():
    return train([])


def test_every_schedule_on_two_ranks_equals_one_process(reference):
    """GPipe and 1F1B (a stage per rank, 2 microbatches), the interleaved and zero-bubble
    schedules (2 stages per rank, 4 microbatches; DualPipeV and ZBV in a V): parameters within
    1e-5 of one process after 4 steps with accumulation 2 and clipping (one norm over both
    stages), the same norms and losses, and the same evaluation and predictions (the V-shaped
    schedules' forward-only pass is their plan without its backward work)."""
    runs = run_distributed(schedules, world_size=2)
    for name in SCHEDULES:
        merged = whole(runs, name)
        assert set(merged) == set(reference["params"]), name  # the model's own names
        assert max_param_diff(merged, reference["params"]) < 1e-5, name
        for rank in runs:
            got = rank[name]
            assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5), name
            assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
            assert got["evaluated"]["loss"] == pytest.approx(reference["evaluated"]["loss"],
                                                             rel=1e-6), name
            assert got["evaluated"]["items"] == reference["evaluated"]["items"]
            torch.testing.assert_close(got["predicted"].logits, reference["predicted"].logits,
                                       rtol=0, atol=1e-5)
            assert got["predicted"].loss.item() == pytest.approx(
                reference["predicted"].loss.item(), rel=1e-6)
        # each rank holds only its stages: the two halves are disjoint
        assert not set(runs[0][name]["params"]) & set(runs[1][name]["params"])
    text = runs[0]["1F1B"]["explain"]
    assert "1F1B over the mesh's pp dimension (2 ranks, 2 stages" in text
    assert "theoretical bubble 33%" in text  # (p - 1) / (m + p - 1) with p = m = 2


def checkpoints(root):
    """pp=2 saves at step 2 (the stages' parts under the model's names) and exports the
    whole model at the end; one process's checkpoint at step 2 resumes at pp=2; and pp=2
    trains with activation checkpointing, and in bf16."""
    _, bundle = built([sw.pipeline_parallel(schedule="1F1B")])
    steps(bundle, bundle.init(), STEPS, save_at=2, root=f"{root}/pp")
    sw.export(f"{root}/export", bundle)
    saved = full_state(bundle.model)
    _, bundle = built([sw.pipeline_parallel(schedule="Interleaved1F1B")])
    state = sw.load(f"{root}/one", bundle)
    state, _, _ = steps(bundle, state, STEPS)
    # the pp=2 checkpoint resumed by 2 data ranks (DDP, a batch of 2 each)
    _, replicated = built([sw.replicate()], data_ranks=2)
    at_dp = sw.load(f"{root}/pp", replicated)
    steps(replicated, at_dp, STEPS)
    return {"saved": saved, "resumed": full_state(bundle.model), "step": state.step,
            "at_dp": full_state(replicated.model),
            "checkpointed": train([sw.pipeline_parallel(), sw.checkpoint_activations()])["params"],
            "bf16": train([sw.pipeline_parallel(), sw.mixed_precision("bf16")])["params"],
            # 3 microbatches for batches of 4: each padded to 6 with unlabelled repeats
            "padded": train([sw.pipeline_parallel(microbatches=3)])["params"],
            # regional compile per stage (AOTAutograd's tracing; inductor costs more time)
            "compiled": train([sw.pipeline_parallel(),
                               sw.compile(backend="aot_eager")])["params"]}


def test_checkpoints_go_from_two_stages_to_one_process_and_back(reference, tmp_path):
    """And the export is the whole model; activation checkpointing, bf16 and regional
    compile per stage."""
    _, alone = built([])
    steps(alone, alone.init(), 2, save_at=2, root=tmp_path / "one")
    runs = run_distributed(checkpoints, str(tmp_path), world_size=2)
    # pp=2's checkpoint at step 2 loads in one process and goes on as one process does
    _, one = built([])
    state = sw.load(tmp_path / "pp", one)
    assert state.step == 2
    steps(one, state, STEPS)
    assert max_param_diff(full_state(one.model), reference["params"]) < 1e-5
    # one process's checkpoint at step 2 resumed on 2 ranks (another schedule) equals it too
    merged = whole([{"r": {"params": r["resumed"]}} for r in runs], "r")
    assert max_param_diff(merged, reference["params"]) < 1e-5
    assert runs[0]["step"] == STEPS
    for rank in runs:  # and at dp=2
        assert max_param_diff(rank["at_dp"], reference["params"]) < 1e-5
    # sw.export gathers every stage's part: the whole model, loadable strictly
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    trained = whole([{"r": {"params": r["saved"]}} for r in runs], "r")
    assert set(exported) == set(reference["params"])
    assert max_param_diff(exported, trained) == 0.0
    llama().load_state_dict(exported, strict=True)
    # per stage: activation checkpointing (exact) and bf16 (within 1.5x of how far bf16
    # itself moves the weights from fp32 in one process)
    checkpointed = whole([{"r": {"params": r["checkpointed"]}} for r in runs], "r")
    assert max_param_diff(checkpointed, reference["params"]) < 1e-5
    compiled = whole([{"r": {"params": r["compiled"]}} for r in runs], "r")
    assert max_param_diff(compiled, reference["params"]) < 1e-5
    padded = whole([{"r": {"params": r["padded"]}} for r in runs], "r")
    assert max_param_diff(padded, reference["params"]) < 1e-5
    bf16 = whole([{"r": {"params": r["bf16"]}} for r in runs], "r")
    drift = max_param_diff(train([sw.mixed_precision("bf16")])["params"], reference["params"])
    assert 0 < max_param_diff(bf16, reference["params"]) <= 1.5 * drift


def nonfinite(stage_rank, on_nonfinite):
    """A NaN in the gradient of one stage's parameter (on rank ``stage_rank``) at step 3."""
    _, bundle = built([sw.pipeline_parallel(schedule="1F1B")])
    calls = []
    hooked = next(p for p in bundle.model.parameters())

    def poison(grad):
        calls.append(1)
        # once per pipeline microbatch (2 per batch, 2 batches per step): step 3's first
        return grad * float("nan") if len(calls) == 9 else grad

    if sw.detect().rank == stage_rank:
        hooked.register_hook(poison)
    state = bundle.init()
    before = None
    try:
        for batch in bundle.loader:
            if state.step == 2 and not state.window_batches:
                before = full_state(bundle.model)
            state, _ = bundle.step(state, batch, on_nonfinite=on_nonfinite)
            if state.step == 3 and not state.window_batches:
                break
        state = bundle.check(state)
    except NonFiniteError as exc:
        return {"raised": str(exc), "unchanged": max_param_diff(full_state(bundle.model), before)}
    return {"skipped": state.skipped_steps,
            "unchanged": max_param_diff(full_state(bundle.model), before)}


def nonfinite_both(stage_rank):
    return {mode: nonfinite(stage_rank, mode) for mode in ("skip", "raise")}


def test_a_nonfinite_gradient_on_one_stage_stops_every_stage():
    runs = run_distributed(nonfinite_both, 0, world_size=2)
    for on_nonfinite in ("skip", "raise"):
        for rank in (r[on_nonfinite] for r in runs):
            assert rank["unchanged"] == 0.0  # nothing applied on either stage
            if on_nonfinite == "skip":
                assert rank["skipped"] == 1
            else:
                assert "non-finite gradients at optimizer step 3" in rank["raised"]


def four_ranks(root):
    """pp=2 x dp_shard=2: each stage sharded (FSDP2) over its 2 data ranks, 1F1B and
    Interleaved1F1B (2 microbatches of a data rank's 2 samples); a checkpoint at step 2.
    And pp=2 x tp=2 with no data ranks (LoopedBFS): no distribution is chosen."""
    staged = [sw.pipeline_parallel(size=2), sw.shard()]
    out = {"1F1B": train(staged, save_at=2, root=root, data_ranks=2),
           "Interleaved1F1B": train([sw.pipeline_parallel(size=2, schedule="Interleaved1F1B",
                                                          microbatches=2), sw.shard()],
                                    data_ranks=2)}
    out["tp"] = train([sw.pipeline_parallel(size=2, schedule="LoopedBFS"),
                       sw.tensor_parallel(size=2)])
    # pp=2 x cp=2: each stage runs a half of every sequence, shard() over the cp ranks
    out["cp"] = train([sw.pipeline_parallel(size=2), sw.context_parallel(size=2)])
    # a zero-bubble schedule's default: shard(reshard_after_forward=False)
    out["InterleavedZeroBubble"] = train([sw.pipeline_parallel(
        size=2, schedule="InterleavedZeroBubble", microbatches=2)], data_ranks=2)
    try:  # a plan refused on a module only the last stage holds
        built([sw.pipeline_parallel(size=2),
               sw.tensor_parallel({"model.layers.3.input_layernorm": "colwise"}, size=2)])
    except ConflictError as exc:  # on every rank, not only the last stage's
        out["refused"] = str(exc)
    return out


def test_two_stages_times_two_data_ranks_on_four_ranks_equal_one_process(reference, tmp_path):
    runs = run_distributed(four_ranks, str(tmp_path), world_size=4)
    assert "refused on the ranks of another pipeline stage" in runs[0]["refused"]
    assert "model.layers.3.input_layernorm" in runs[2]["refused"]
    split = {**runs[0]["tp"]["params"], **runs[2]["tp"]["params"]}  # pp=2 x tp=2
    assert max_param_diff(split, reference["params"]) < 1e-5
    for rank in runs:
        assert rank["tp"]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert rank["tp"]["evaluated"]["loss"] == pytest.approx(reference["evaluated"]["loss"],
                                                                rel=1e-6)
    assert ("no distribution transform: default: pipeline_parallel x tensor_parallel groups "
            "of 4 ranks leave 1 rank(s) holding each part") in runs[0]["tp"]["explain"]
    sliced = {**runs[0]["cp"]["params"], **runs[2]["cp"]["params"]}  # pp=2 x cp=2
    assert max_param_diff(sliced, reference["params"]) < 1e-5
    batch = next(iter(DataLoader(Prompts(), batch_size=GLOBAL_BATCH)))
    real = batch["attention_mask"].bool()  # cp attends causally: padding's logits differ
    for rank in runs:
        got = rank["cp"]
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert got["evaluated"]["loss"] == pytest.approx(reference["evaluated"]["loss"],
                                                         rel=1e-6)
        torch.testing.assert_close(got["predicted"].logits[real],
                                   reference["predicted"].logits[real], rtol=0, atol=1e-5)
        assert got["predicted"].loss.item() == pytest.approx(
            reference["predicted"].loss.item(), rel=1e-6)
    assert "shard(policy=auto(), reshard_after_forward=False" in \
        runs[0]["InterleavedZeroBubble"]["explain"]
    for name in ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble"):
        # ranks 0, 1 are one pipeline (data rank 0), 2, 3 the other: each holds its stages
        merged = whole(runs[:2], name)
        assert max_param_diff(merged, reference["params"]) < 1e-5, name
        assert max_param_diff(whole(runs[2:], name), merged) == 0.0  # the replicas agree
        for rank in runs:
            evaluated_as_one_process(rank[name], reference, name)
    assert "dp_shard=2 x pp=2" in runs[0]["1F1B"]["explain"]
    resumed_in_one_process(tmp_path, reference)  # saved by 4 ranks, sharded and staged


def evaluated_as_one_process(got, reference, name):
    """A data rank's norms, sw.evaluate (whole and over padded shards) and the logits
    gathered for metrics, as one process's."""
    assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5), name
    assert got["evaluated"]["loss"] == pytest.approx(reference["evaluated"]["loss"],
                                                     rel=1e-6), name
    # the repeated sample's labels masked, not cut (the microbatches divide 2)
    assert got["padded"] == pytest.approx(reference["padded"], rel=1e-6), name
    # gather_for_metrics: each sample's logits once, as one process predicts them
    assert got["gathered"].shape[0] == 11
    torch.testing.assert_close(got["gathered"], reference["gathered"], rtol=0, atol=1e-5)


def resumed_in_one_process(root, reference):
    """The checkpoint at step 2 under ``root``, loaded and trained on in one process."""
    _, one = built([])
    state = sw.load(root, one)
    assert state.step == 2
    steps(one, state, STEPS)
    assert max_param_diff(full_state(one.model), reference["params"]) < 1e-5


def with_tensor_parallel(root):
    """pp=2 x tp=2 x dp_shard=2: each stage's layers split over its 2 tensor-parallel ranks,
    and each stage's parts sharded (FSDP2) over its 2 data ranks; 1F1B (a checkpoint at step
    2) and Interleaved1F1B."""
    return {name: train([sw.pipeline_parallel(size=2, schedule=name, microbatches=2),
                         sw.tensor_parallel(size=2), sw.shard()],
                        save_at=2 if name == "1F1B" else None, root=root, data_ranks=2)
            for name in ("1F1B", "Interleaved1F1B")}


def test_stages_times_tensor_parallel_times_data_ranks_on_eight_ranks_equal_one_process(
        reference, tmp_path):
    """Parameters, norms, losses, evaluation and predictions as one process's; the 8-rank
    checkpoint (the stages' parts split into DTensors and sharded) resumed in one process."""
    runs = run_distributed(with_tensor_parallel, str(tmp_path), world_size=8)
    for name in ("1F1B", "Interleaved1F1B"):
        # mesh dp_shard=2 x pp=2 x tp=2: ranks 0-3 read data share 0, 4-7 share 1; ranks 0, 1
        # split the stage(s) of pipeline rank 0, ranks 2, 3 those of pipeline rank 1
        merged = {**runs[0][name]["params"], **runs[2][name]["params"]}
        assert set(merged) == set(reference["params"]), name
        assert max_param_diff(merged, reference["params"]) < 1e-5, name
        for peer in (1, 4, 5):  # its tensor-parallel peer and its data replicas agree
            assert max_param_diff(runs[peer][name]["params"], runs[0][name]["params"]) == 0.0
        for rank in runs:
            evaluated_as_one_process(rank[name], reference, name)
            torch.testing.assert_close(rank[name]["predicted"].logits,
                                       reference["predicted"].logits, rtol=0, atol=1e-5)
    assert "dp_shard=2 x pp=2 x tp=2" in runs[0]["1F1B"]["explain"]
    resumed_in_one_process(tmp_path, reference)


def mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def regression(parts, loss_fn=None):
    """An nn.Sequential of 5 children trained 4 steps (SGD) on batches (inputs, target)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 8, generator=generator),
                         torch.randn(16, 4, generator=generator))
    bundle = sw.pipeline(sw.detect(), *parts)(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              DataLoader(data, batch_size=4), loss_fn=loss_fn)
    state = bundle.init()
    for batch in bundle.loader:
        state, _ = bundle.step(state, batch)
    bundle.check(state)
    return full_state(bundle.model), bundle


def refusals():
    found = {}

    def refused(name, make):
        try:
            make()
        except (ConflictError, ArgumentError) as exc:
            found[name] = str(exc)

    refused("stages", lambda: built([sw.pipeline_parallel(schedule="Interleaved1F1B",
                                                          stages_per_rank=4)]))
    refused("tied", lambda: built([sw.pipeline_parallel()], model=llama(tied=True)))
    refused("dualpipe", lambda: built([sw.pipeline_parallel(schedule="DualPipeV",
                                                            microbatches=2)]))
    params, bundle = regression([sw.pipeline_parallel(loss=mse)])
    found["sequential"] = params
    short = next(iter(bundle.loader))
    refused("microbatches", lambda: bundle.step(bundle.init(), (short[0][:3], short[1][:3])))
    # more microbatches than samples: refused, not padded (2^20 of them used to stall)
    refused("too_many", lambda: built([sw.pipeline_parallel(microbatches=1048576)]))
    model = llama()
    loose = sw.pipeline(sw.detect(), sw.pipeline_parallel(microbatches=4))(
        model, torch.optim.AdamW(model.parameters()))  # no loader: the batch is all it knows
    two = next(iter(DataLoader(Prompts(), batch_size=2)))
    refused("too_many_step", lambda: loose.step(loose.init(), two))
    refused("loss_fn", lambda: sw.pipeline(sw.pipeline_parallel())(
        llama(), None, loss_fn=token_sum))
    refused("split", lambda: built([sw.pipeline_parallel(split=["model.layers.9"])]))
    cut = llama()
    cut._pp_stage = type("Stage", (), {"pp_size": 2})()  # what Transformers' own split leaves
    refused("transformers", lambda: built([sw.pipeline_parallel()], model=cut))
    found["explain"] = sw.pipeline(sw.pipeline_parallel()).explain(llama())
    found["given"] = sw.pipeline(sw.pipeline_parallel(split=["model.layers.1"])).explain(llama())
    return found


def test_what_cannot_be_cut_or_divided_is_refused_naming_the_numbers():
    runs = run_distributed(refusals, world_size=2)
    found = runs[0]
    assert "4 stages per rank" not in found["stages"]
    assert "8 stages, but the model has 4 layers" in found["stages"]
    assert "ties lm_head to embed_tokens" in found["tied"]
    assert "torch's DualPipeV schedule refuses 2 microbatches for 4 stages on 2 ranks" in \
        found["dualpipe"]
    assert "2 microbatches; a batch of 3 samples does not divide (only a decoder's batch " \
        "under the causal LM token-sum loss is padded" in found["microbatches"]
    # an nn.Sequential cut between its children, its loss given to pipeline_parallel
    alone, _ = regression([], loss_fn=lambda model, batch: mse(model(batch[0]), batch[1]))
    assert max_param_diff({**found["sequential"], **runs[1]["sequential"]}, alone) < 1e-6
    assert "1048576 microbatches for the loader's batches of 4 samples" in found["too_many"]
    assert "microbatches must be at most the batch size (4)" in found["too_many"]
    assert "a batch of 2 samples cannot fill them" in found["too_many_step"]
    assert "drop loss_fn" in found["loss_fn"]
    assert "'model.layers.9', which is not a layer" in found["split"]
    assert "cut already by Transformers' distributed_config(pp_size=2)" in found["transformers"]
    # explain(model) names each stage's layers: balanced by parameters, or where given
    assert "stages: stage 0: model.layers.0-1 (+ embeddings)" in found["explain"]
    assert "stage 1: model.layers.2-3 (+ norm and head)" in found["explain"]
    assert "stage 0: model.layers.0 (+ embeddings)" in found["given"]


def _tied_v_shaped_and_sharded():
    model = llama(layers=4, tied=True)
    parts = (sw.pipeline_parallel(size=2, schedule="ZBVZeroBubble"),
             sw.shard(reshard_after_forward=False))
    try:
        sw.pipeline(sw.detect(), *parts)(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ConflictError as exc:
        return str(exc)
    return None


def test_a_tied_weight_of_two_sharded_stages_is_refused_on_every_rank():
    """Rank 0 of a V-shaped schedule holds the first and the last stage, so the tied
    embedding and head are one weight there; FSDP2 shards each stage apart and made two
    (0.023 apart after 2 steps, where the pipeline alone keeps them equal). Refused on every
    rank (the others would wait in fully_shard), naming the two names on rank 0."""
    errors = run_distributed(_tied_v_shaped_and_sharded, world_size=4)
    assert all(e is not None and "train apart" in e for e in errors), errors
    assert "model.embed_tokens.weight and lm_head.weight are one weight in stages 0 and 1" \
        in errors[0]
    assert "another rank's pipeline stages share a weight" in errors[1]
