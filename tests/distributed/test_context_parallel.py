# context_parallel() on real gloo ranks: cp=2, cp=4 and dp_shard=2 x cp=2 against one process.
# Its tests that start no process are in tests/unit/test_parallel_plans.py.
"""A tiny Transformers Llama with per-sample prompt masks and right padding, trained 4
optimizer steps (accumulation 2, clipping) with each sequence split across a context-parallel
group, must match one process on the same global batches; its evaluation loss, token accuracy
and gathered logits must too."""

import pytest
import torch
from torch.utils.data import DataLoader, Subset

import shardwise as sw
from shardwise.errors import ConflictError
from shardwise.testing import full_state, max_param_diff, run_distributed

from conftest import Prompts
from conftest import llama as shared_llama

pytest.importorskip("transformers")

GLOBAL_BATCH = 4
STEPS = 4  # optimizer steps
ACCUMULATE = 2
SEQ = 16


def llama():
    return shared_llama(layers=2)


class Attention(torch.nn.Module):
    """A model's own attention outside Transformers, hooked as docs/parallelism.md shows."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.context_parallel = None

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

        def attend(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = attend(q, k, v) if self.context_parallel is None else \
            self.context_parallel.attend(q, k, v, attend)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


class OwnModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.attn = torch.nn.Embedding(64, 32), Attention()
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids):
        return self.head(self.attn(self.embed(input_ids)))


def slice_sum(model, batch):
    """A loss_fn for either form of batch: whole (labels to shift) or a slice (shift_labels)."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    logits = model(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def own_model(parts):
    """OwnModel trained 4 optimizer steps (accumulation 2, SGD: an update linear in the
    gradient, so a wrong token weight shows at once) with slice_sum."""
    model = OwnModel()
    bundle = sw.pipeline(sw.detect(), *parts, sw.accumulate_gradients(ACCUMULATE))(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(Prompts(), batch_size=GLOBAL_BATCH, shuffle=True), loss_fn=slice_sum)
    state = bundle.init()
    for batch in bundle.loader:
        state, _ = bundle.step(state, batch)
        if state.step == STEPS:
            break
    # predict gives whole-sequence outputs; the split's extra keys are not passed to a
    # forward that takes only input_ids
    return full_state(bundle.model), bundle.predict({"input_ids": Prompts().ids[:3]})


def token_sum(model, batch):
    """One process's reference: the summed loss of the whole batch and its labelled tokens."""
    out = model(**batch, num_items_in_batch=1)
    return out.loss, (batch["labels"][:, 1:] != -100).sum()


def built(parts, data_ranks=1):
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = DataLoader(Prompts(), batch_size=GLOBAL_BATCH // data_ranks, shuffle=True)
    pipe = sw.pipeline(sw.detect(), *parts, sw.accumulate_gradients(ACCUMULATE),
                       sw.clip_gradients(0.5))
    split = any(isinstance(p, sw.transforms.ContextParallel) for p in parts)
    return pipe, pipe(model, opt, loader, loss_fn=None if split else token_sum)


def steps(bundle, state, until, save_at=None, root=None):
    """Train until optimizer step ``until`` (saving at step ``save_at``); the clipping norms."""
    norms = []
    for batch in bundle.loader:
        state, out = bundle.step(state, batch)
        if out.grad_norm is not None:
            norms.append(out.grad_norm.item())
        if state.step == save_at and not state.window_batches:
            sw.save(root, bundle, state)
        if state.step == until:
            break
    return bundle.check(state), norms


def train(parts, data_ranks=1, save_at=None, root=None):
    pipe, bundle = built(parts, data_ranks)
    state, norms = steps(bundle, bundle.init(), STEPS, save_at, root)
    return {"params": full_state(bundle.model), "norms": norms, "explain": pipe.explain(),
            "engine": bundle.engine.name, "metrics": evaluate(bundle)}


def evaluate(bundle):
    """Over 9 samples (padding on 2 data ranks): the mean loss over labelled tokens, token
    accuracy, the logits of real tokens gathered for metrics, and predict's loss of one batch
    given to every rank (the mean over its labelled tokens)."""
    loader = bundle.distribute(DataLoader(Subset(Prompts(), range(9)), batch_size=2))
    loss_sum = correct = tokens = mine = 0.0
    logits, ids = [], []
    for batch in loader:
        out = bundle.predict(batch)
        mine += torch.nn.functional.cross_entropy(  # this rank's batch: the same in a cp group
            out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
            reduction="sum").item()
        got, labels, mask, inputs = sw.gather_for_metrics(
            (out.logits, batch["labels"], batch["attention_mask"], batch["input_ids"]), loader)
        logits.append(got * mask[..., None])  # padding's logits: no loss, masked differently
        ids.append(inputs)
        shifted, predicted = labels[:, 1:], got[:, :-1].argmax(-1)
        real = shifted != -100
        loss_sum += torch.nn.functional.cross_entropy(
            got[:, :-1].flatten(0, 1), shifted.flatten(), reduction="sum").item()
        correct += (predicted == shifted)[real].sum().item()
        tokens += real.sum().item()
    ids = torch.cat(ids)  # gathered in rank order: put the samples in one order to compare
    order = sorted(range(len(ids)), key=lambda i: ids[i].tolist())
    return {"loss": loss_sum / tokens, "accuracy": correct / tokens,
            "logits": torch.cat(logits)[order], "samples": len(ids),
            "reduced_sum": sw.reduce(mine, "sum", loader).item(),
            "evaluated": sw.evaluate(bundle, loader)["loss"],
            "batch_loss": bundle.predict(next(iter(DataLoader(Prompts(), batch_size=3)))).loss.item()}


def two_ranks(root):
    return {"cp2": train([sw.context_parallel(size=2)], save_at=2, root=root),
            "cp2_shard": train([sw.context_parallel(size=2), sw.shard()]),
            "own_model": own_model([sw.context_parallel(size=2)]),
            "checkpointed": train([sw.context_parallel(size=2), sw.checkpoint_activations(),
                                   sw.shard()])["params"],
            "bf16": train([sw.context_parallel(size=2), sw.mixed_precision("bf16")])["params"],
            # AOTAutograd's tracing of the exchange (inductor's code generation costs more time
            # than it tests: measured by hand, docs/parallelism.md)
            "compiled": train([sw.context_parallel(size=2),
                               sw.compile(backend="aot_eager")])["params"]}


def four_ranks():
    return {"cp4": train([sw.context_parallel(size=4)]),
            "dp2_cp2": train([sw.context_parallel(size=2), sw.shard()], data_ranks=2),
            "cp2_tp2": train([sw.context_parallel(size=2), sw.tensor_parallel(size=2)]),
            # size=None: sized from the pipeline's one layout beside tp=2 (2 ranks); it sized
            # itself alone (4) and asked for cp=4 on a cp=2 mesh
            "cp_tp2": train([sw.context_parallel(), sw.tensor_parallel(size=2)])}


@pytest.fixture(scope="module")
def reference():
    return train([])


def _same(got, reference):
    assert max_param_diff(got["params"], reference["params"]) < 1e-5
    assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    mine, theirs = got["metrics"], reference["metrics"]
    assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert mine["accuracy"] == pytest.approx(theirs["accuracy"], rel=1e-6)
    # sw.evaluate: each labelled token once, padding dropped, slices and copies counted once
    assert mine["evaluated"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert theirs["evaluated"] == pytest.approx(theirs["loss"], rel=1e-9)
    assert mine["samples"] == theirs["samples"] == 9  # each sample once, padding dropped
    torch.testing.assert_close(mine["logits"], theirs["logits"], rtol=0, atol=1e-5)
    assert mine["batch_loss"] == pytest.approx(theirs["batch_loss"], rel=1e-6)


def test_context_parallel_on_two_ranks_equals_one_process(reference, tmp_path):
    """cp=2 under DDP and under shard(): parameters within 1e-5 of one process after 4 steps
    (accumulation 2, clipping), the clipping norms, eval loss and token accuracy to 1e-6; and
    a checkpoint saved at cp=2 resumed in one process; with activation checkpointing and
    shard(), compiled, and in bf16; a model of one's own hooked through its attention's
    attribute."""
    runs = run_distributed(two_ranks, str(tmp_path), world_size=2)
    for name in ("cp2", "cp2_shard"):
        for rank in runs:
            _same(rank[name], reference)
    assert "cp=2" in runs[0]["cp2"]["explain"]
    # its checkpoint at step 2 loads in one process and goes on as one process does
    _, alone = built([])
    state = sw.load(tmp_path, alone)
    assert state.step == 2
    state, _ = steps(alone, state, STEPS)
    assert max_param_diff(full_state(alone.model), reference["params"]) < 1e-5
    # sw.reduce(x, "sum", loader) counts each cp pair's value once (one data rank: no padding)
    for rank in runs:
        assert rank["cp2"]["metrics"]["reduced_sum"] == pytest.approx(
            reference["metrics"]["reduced_sum"], rel=1e-6)
    # composed with activation checkpointing (and shard()), and with bf16 autocast: within
    # 1.5x of how far bf16 itself moves the weights from fp32 in one process
    bf16 = max_param_diff(train([sw.mixed_precision("bf16")])["params"], reference["params"])
    for rank in runs:
        assert max_param_diff(rank["checkpointed"], reference["params"]) < 1e-5
        assert max_param_diff(rank["compiled"], reference["params"]) < 1e-5
        assert 0 < max_param_diff(rank["bf16"], reference["params"]) <= 1.5 * bf16
    # a model outside Transformers, hooked through its declared context_parallel attribute
    alone, logits = own_model([])
    for rank in runs:
        assert max_param_diff(rank["own_model"][0], alone) < 1e-5
        torch.testing.assert_close(rank["own_model"][1], logits, rtol=0, atol=1e-5)
    assert runs[0]["cp2_shard"]["engine"] == "FSDP2"


def test_context_parallel_on_four_ranks_equals_one_process(reference):
    """cp=4 (key/value heads repeated: 2 < 4), dp_shard=2 x cp=2, and cp=2 x tp=2 (each
    tensor-parallel rank's 2 heads split over its context-parallel pair; FSDP2 over the cp
    ranks) on 4 gloo ranks."""
    runs = run_distributed(four_ranks, world_size=4)
    for rank in runs:
        _same(rank["cp4"], reference)
        _same(rank["dp2_cp2"], reference)
        _same(rank["cp2_tp2"], reference)
        _same(rank["cp_tp2"], reference)
    assert "dp_shard=2 x cp=2" in runs[0]["dp2_cp2"]["explain"]
    assert "cp dimension (2 ranks)" in runs[0]["cp_tp2"]["explain"]
    assert "dp_shard=1 x cp=2 x tp=2" in runs[0]["cp2_tp2"]["explain"]


def refusals():
    """What context_parallel refuses before anything is split, each on every rank."""
    model = llama()
    bundle = sw.pipeline(sw.detect(), sw.context_parallel(size=2))(
        model, torch.optim.AdamW(model.parameters()))
    found = {}
    batches = {"odd_length": {"input_ids": torch.ones(2, 15, dtype=torch.long),
                              "labels": torch.ones(2, 15, dtype=torch.long)},
               "left_padding": {"input_ids": torch.ones(2, 16, dtype=torch.long),
                                "labels": torch.ones(2, 16, dtype=torch.long),
                                "attention_mask": torch.tensor([[0] * 4 + [1] * 12] * 2)},
               "no_labels": {"input_ids": torch.ones(2, 16, dtype=torch.long)},
               "packed": {"input_ids": torch.ones(1, 16, dtype=torch.long),
                          "labels": torch.ones(1, 16, dtype=torch.long),
                          "position_ids": torch.cat([torch.arange(8), torch.arange(8)])[None]}}
    for name, batch in batches.items():
        try:
            bundle.step(bundle.init(), batch)
            found[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            found[name] = f"{type(exc).__name__}: {exc}"
    # a NaN on rank 1's slice alone: both ranks refuse the step, nothing is applied
    batch = next(iter(DataLoader(Prompts(), batch_size=2)))
    state, _ = bundle.step(bundle.init(), batch)
    before = full_state(bundle.model)
    if sw.detect().rank == 1:
        with torch.no_grad():
            bundle.model.module.model.norm.weight[0] = float("nan")
    try:
        bundle.check(bundle.step(state, batch)[0])
        found["nonfinite"] = "no error"
    except sw.errors.NonFiniteError as exc:
        found["nonfinite"] = str(exc).split(";")[0]
    with torch.no_grad():
        bundle.model.module.model.norm.weight.copy_(before["model.norm.weight"])
    found["unchanged"] = max_param_diff(full_state(bundle.model), before)
    import copy

    copy.deepcopy(bundle.model)  # an EMA or reference copy shares the split
    try:  # a direct call on whole sequences: not split, refused
        bundle.model(**{k: v for k, v in batch.items() if k != "attention_mask"})
        found["direct"] = "no error"
    except ConflictError as exc:
        found["direct"] = str(exc)
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4))
    flex = llama()
    flex.config._attn_implementation = "flex_attention"
    for name, model in (("encoder", bert), ("flex", flex)):
        try:
            sw.pipeline(sw.detect(), sw.context_parallel(size=2))(
                model, torch.optim.SGD(model.parameters()))
            found[name] = "no error"
        except ConflictError as exc:
            found[name] = str(exc)

    three = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=3,
                                         num_key_value_heads=3))
    try:
        sw.pipeline(sw.detect(), sw.context_parallel(size=2))(three, torch.optim.SGD(three.parameters()))
        found["heads"] = "no error"
    except ConflictError as exc:
        found["heads"] = str(exc)
    return found


def test_context_parallel_refuses_what_it_cannot_split():
    """Lengths, masks, packed documents and batches it cannot split are refused naming them,
    as are encoders, flex attention (no mask: bidirectional) and a direct call on whole
    sequences; a non-finite loss on one rank's slice stops the step on both, with nothing
    applied; a hooked model can be deep-copied."""
    for found in run_distributed(refusals, world_size=2):
        assert "ConflictError" in found["odd_length"] and "length 15" in found["odd_length"]
        assert "left padding" in found["left_padding"]
        assert "LossError" in found["no_labels"] and "'labels'" in found["no_labels"]
        assert found["nonfinite"].startswith("non-finite gradients at optimizer step 2")
        assert found["unchanged"] == 0
        assert "this model has 3" in found["heads"]  # heads refused before anything is split
        assert "packed documents" in found["packed"]
        assert "call the model through bundle.step" in found["direct"]
        assert "splits causal language models" in found["encoder"]
        assert "'flex_attention' does not honour" in found["flex"]


def unlabelled(parts_list):
    """The error of a first step whose batch has no labelled token, under each of
    ``parts_list`` (fused AdamW: the check is read at the next call; SGD: at once)."""
    found = []
    for parts, optimizer in parts_list:
        model = llama()
        data = Prompts(size=8, seq=SEQ)
        data.labels[:] = -100
        opt = optimizer(model.parameters(), lr=1e-3)
        bundle = sw.pipeline(sw.detect(), *parts)(model, opt, DataLoader(data, batch_size=4))
        state = bundle.init()
        try:
            state, _ = bundle.step(state, next(iter(bundle.loader)))
            bundle.check(state)
            found.append("no error")
        except sw.errors.NonFiniteError as exc:
            found.append(str(exc))
    return found


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, fused=True)


def test_a_window_without_labelled_tokens_is_named_the_same_on_every_layout():
    """Every label -100: the error says so (not the learning rate), in the same words in one
    process and on 2 ranks under replicate, context_parallel and pipeline_parallel."""
    layouts = [([], adamw), ([], torch.optim.SGD), ([sw.replicate()], adamw),
               ([sw.context_parallel()], adamw), ([sw.context_parallel()], torch.optim.SGD),
               ([sw.pipeline_parallel()], adamw)]
    alone = unlabelled(layouts[:2])
    ranks = run_distributed(unlabelled, layouts[2:], world_size=2)
    for text in alone + ranks[0] + ranks[1]:
        assert "optimizer step 1 (micro-step 1): its window holds no labelled token on any " \
               "rank (every label is -100" in text, text
        assert "learning rate" not in text and "Check the labels and masks" in text
