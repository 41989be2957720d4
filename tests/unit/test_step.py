# Bundle.step in one process: loss forms, accumulation, token weighting, clipping, precision.
import collections
import copy

import attrs
import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import LossError, NonFiniteError, OptimizerError
from shardwise.testing import SyntheticRegression, TinyMLP, TinyTransformerLM, max_param_diff

from conftest import ONE, masked_micro_batches, token_loss, train_steps


def mlp_and_sgd(seed=0, lr=0.1):
    torch.manual_seed(seed)
    model = TinyMLP()
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def test_loss_forms_attribute_mapping_scalar_and_loss_fn():
    Out = collections.namedtuple("Out", "loss logits")

    class AttrModel(TinyMLP):
        def forward(self, x, y):
            return Out(super().forward(x, y), None)

    class DictModel(TinyMLP):
        def forward(self, x, y):
            return {"loss": super().forward(x, y)}

    x, y = torch.randn(4, 8), torch.randn(4, 1)
    losses = []
    for cls, batch in ((AttrModel, (x, y)), (DictModel, [x, y]), (TinyMLP, {"x": x, "y": y})):
        torch.manual_seed(0)
        model = cls()
        bundle = sw.pipeline(ONE)(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses.append(bundle.step(bundle.init(), batch)[1].loss)
    torch.manual_seed(0)
    model = TinyMLP()
    bundle = sw.pipeline(ONE)(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    losses.append(bundle.step(bundle.init(), (x, y))[1].loss)
    assert all(torch.equal(losses[0], other) for other in losses[1:])


def test_missing_loss_says_to_pass_loss_fn():
    model, opt = mlp_and_sgd()
    bundle = sw.pipeline(ONE)(model, opt)
    with pytest.raises(LossError, match="output of type Tensor.*pass loss_fn="):
        bundle.step(bundle.init(), torch.randn(4, 8))
    assert isinstance(LossError("x"), TypeError)


def test_step_without_optimizer_is_refused():
    bundle = sw.pipeline(ONE)(TinyMLP())
    with pytest.raises(OptimizerError, match="step\\(\\) needs an optimizer"):
        bundle.step(bundle.init(), (torch.randn(2, 8), torch.randn(2, 1)))


def test_accumulation_equals_one_step_on_the_concatenated_window():
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
    model, opt = mlp_and_sgd()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(4))(model, opt)
    state = bundle.init()
    stepped = []
    for batch in data:
        state, out = bundle.step(state, batch)
        stepped.append(out.stepped)
    assert stepped == [False, False, False, True] * 2
    assert (state.step, state.micro_step) == (2, 8)
    for w in range(2):
        x = torch.cat([b[0] for b in data[4 * w:4 * w + 4]])
        y = torch.cat([b[1] for b in data[4 * w:4 * w + 4]])
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert max_param_diff(model, ref) <= 1e-6


def test_token_weighted_loss_over_uneven_micro_batches_equals_the_whole_window():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (6, 10))
    labels = ids.roll(-1, 1).clone()
    labels[torch.rand(labels.shape) < 0.5] = -100  # uneven counts per micro-batch
    micro = [{"input_ids": ids[i:i + 2], "labels": labels[i:i + 2]} for i in (0, 2, 4)]
    assert len({int((m["labels"] != -100).sum()) for m in micro}) > 1
    torch.manual_seed(1)
    model = TinyTransformerLM()
    ref = copy.deepcopy(model)
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(3))(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=token_loss)
    state = bundle.init()
    for batch in micro:
        state, out = bundle.step(state, batch)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    total, count = token_loss(ref, {"input_ids": ids, "labels": labels})
    (total / count).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) <= 1e-6
    assert out.stepped and out.grad_norm is None  # no clipping, so no norm computed
    assert out.loss.dtype == torch.float32


def weighted_window(split_at=None, rebuild=lambda bundle: attrs.evolve(bundle)):
    """Parameters after one token-weighted window of 3 micro-batches; with ``split_at``, the
    window continues on ``rebuild(bundle)`` from that micro-batch on."""
    micro = masked_micro_batches()
    torch.manual_seed(1)
    model = TinyTransformerLM()
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(3))(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=token_loss)
    state, outs = train_steps(bundle, bundle.init(), micro[:split_at])
    if split_at is not None:
        state, more = train_steps(rebuild(bundle), state, micro[split_at:])
        outs += more
    assert [o.stepped for o in outs] == [False, False, True]
    return {k: v.clone() for k, v in model.state_dict().items()}, state


@pytest.mark.parametrize("rebuild", [lambda b: attrs.evolve(b), lambda b: sw.Bundle(
    b.model, b.optimizer, env=b.env, plan=b.plan, loss_fn=b.loss_fn, engine=b.engine)],
    ids=["evolve", "new-bundle"])
def test_a_window_continued_on_another_bundle_trains_as_the_original(rebuild):
    straight, end = weighted_window()
    for split in (1, 2):
        split_run, split_end = weighted_window(split, rebuild)
        assert all(torch.equal(straight[k], split_run[k]) for k in straight)
        assert split_end == end and split_end.window_items is None


def test_the_window_lives_in_the_state_and_is_not_saved():
    micro = masked_micro_batches()
    model = TinyTransformerLM()
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(3))(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=token_loss)
    state, _ = train_steps(bundle, bundle.init(), micro[:2])
    expected = sum(int((m["labels"] != -100).sum()) for m in micro[:2])
    assert state.window_weighted is True and int(state.window_items) == expected
    assert state.to_dict() == {"step": 0, "micro_step": 2, "epoch": 0, "batch_in_epoch": 2,
                               "skipped_steps": 0}
    assert sw.TrainState.from_dict(state.to_dict()).window_items is None


def test_clip_gradients_clips_and_returns_the_norm_before():
    model, opt = mlp_and_sgd(lr=1.0)
    ref = copy.deepcopy(model)
    batch = (torch.randn(16, 8) * 10, torch.randn(16, 1) * 10)
    bundle = sw.pipeline(ONE, sw.clip_gradients(0.01))(model, opt)
    _, out = bundle.step(bundle.init(), batch)
    ref(*batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert out.grad_norm is not None and torch.allclose(out.grad_norm, expected)
    assert expected > 0.01
    assert max_param_diff(model, ref) <= 1e-6


def checked_step(bundle, batch):
    """One step from a fresh state, its finiteness check read (fused kernels read it late)."""
    state, out = bundle.step(bundle.init(), batch)
    return bundle.check(state), out


def nan_batch():
    return torch.full((4, 8), float("nan")), torch.zeros(4, 1)


def test_non_finite_raises_naming_the_step_by_default():
    model, opt = mlp_and_sgd()
    bundle = sw.pipeline(ONE)(model, opt)
    state, _ = bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    after_first = copy.deepcopy(model)
    # fused SGD skips the update on the device; the next step reads the flag and names it
    state, _ = bundle.step(state, nan_batch())
    assert max_param_diff(model, after_first) == 0.0
    with pytest.raises(NonFiniteError, match="at optimizer step 2 .micro-step 2.*skipped on the "
                       "device.*seen at micro-step 3.*on_nonfinite='skip'"):
        bundle.step(state, (torch.randn(4, 8), torch.randn(4, 1)))
    assert max_param_diff(model, after_first) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_raises_at_once_without_a_fused_kernel():
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)  # an implementation chosen
    bundle = sw.pipeline(ONE)(model, opt)
    assert opt.param_groups[0]["fused"] is None
    state, _ = bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    assert state.pending_check is None
    with pytest.raises(NonFiniteError, match="at optimizer step 2 .micro-step 2.*nothing was "
                       "applied.*on_nonfinite='skip'"):
        bundle.step(state, nan_batch())


@pytest.mark.parametrize("where", ["pipeline", "step"])
def test_non_finite_skip_counts_and_leaves_weights(where):
    model, opt = mlp_and_sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pipe = sw.pipeline(ONE, on_nonfinite="skip" if where == "pipeline" else "raise")
    bundle = pipe(model, opt, scheduler=sched)
    before = copy.deepcopy(model)
    kwargs = {"on_nonfinite": "skip"} if where == "step" else {}
    state, out = bundle.step(bundle.init(), nan_batch(), **kwargs)
    assert (state.step, state.skipped_steps, out.stepped) == (1, 1, False)
    assert max_param_diff(model, before) == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == 0.1  # the scheduler did not step either
    state, out = bundle.step(state, (torch.randn(4, 8), torch.randn(4, 1)))
    # the update used 0.1 (out.lr, what the Trainer logs), then the scheduler stepped
    assert out.stepped and out.lr == 0.1 and state.skipped_steps == 1
    assert opt.param_groups[0]["lr"] == 0.05


def test_bf16_trains_under_autocast_and_keeps_fp32_master_weights():
    torch.manual_seed(0)
    model = TinyTransformerLM()
    ref = copy.deepcopy(model)
    seen = []
    model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loader = DataLoader(sw.testing.SyntheticTokens(size=64), batch_size=8, shuffle=True)
    bundle = sw.pipeline(ONE, sw.mixed_precision("bf16"))(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), loader)
    state, losses = bundle.init(), []
    for batch in bundle.loader:
        state, out = bundle.step(state, batch)
        losses.append(out.loss.item())
    assert seen[0] == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in bundle.optimizer.state.values())
    assert losses[-1] < losses[0]
    assert max_param_diff(model, ref) > 0


def test_two_param_groups_keep_their_hyperparameters():
    model = TinyMLP()
    decay = [model.fc1.weight, model.fc2.weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}],
                            lr=1e-3)
    bundle = sw.pipeline(ONE)(model, opt)
    assert bundle.optimizer is opt
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["params"][0] is bundle.model.fc1.weight


def test_state_follows_the_loader_epochs_and_is_new_each_step():
    model, opt = mlp_and_sgd()
    loader = DataLoader(SyntheticRegression(size=24), batch_size=8, shuffle=True)
    bundle = sw.pipeline(ONE)(model, opt, loader)
    state = first = bundle.init()
    seen = []
    for _ in range(2):
        for batch in bundle.loader:
            new, _ = bundle.step(state, batch)
            assert new is not state
            state = new
            seen.append((state.epoch, state.batch_in_epoch))
    # the end of an epoch is the start of the next: (1, 0), where the loader goes on
    assert seen == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert first == sw.TrainState() and state.step == 6
    assert sw.TrainState.from_dict(state.to_dict()) == state


def test_non_finite_gradient_with_a_finite_loss_is_caught():
    model, opt = mlp_and_sgd()

    def sqrt_at_zero(m, batch):  # loss 0, gradient nan
        return (m.fc1.weight * 0).abs().sqrt().sum() + m(batch).sum() * 0

    bundle = sw.pipeline(ONE)(model, opt, loss_fn=sqrt_at_zero)
    with pytest.raises(NonFiniteError, match="non-finite gradients at optimizer step 1"):
        checked_step(bundle, torch.randn(2, 8))


def test_fp16_scaler_skips_overflowing_steps_and_counts_them():
    # fp16 is refused on a CPU by default; an env that claims it exercises the scaler path
    env = sw.Env(precisions=("fp32", "bf16", "fp16"))
    model, opt = mlp_and_sgd(lr=1e-6)
    bundle = sw.pipeline(env, sw.mixed_precision("fp16"))(model, opt)
    assert bundle.scaler is not None and bundle.scaler.get_scale() == 2.0**16
    batch = (torch.randn(64, 8) * 100, torch.randn(64, 1) * 100)
    state, outs = bundle.init(), []
    for _ in range(20):
        state, out = bundle.step(state, batch)
        outs.append(out.stepped)
    skipped = outs.count(False)
    assert skipped >= 1 and state.skipped_steps == skipped  # the first scales overflow fp16
    assert bundle.scaler.get_scale() == 2.0**16 / 2**skipped
    assert outs[-1] and all(p.dtype == torch.float32 for p in model.parameters())
    state, out = bundle.step(state, (torch.full((4, 8), float("nan")), torch.zeros(4, 1)))
    assert not out.stepped and state.skipped_steps == skipped + 1


@pytest.mark.parametrize("returned, shown", [
    (lambda loss, logits: (loss, logits), "Tensor(), Tensor(4, 1)"),
    (lambda loss, logits: (loss, 3, 4), "Tensor(), int, int"),
    (lambda loss, logits: (logits, 3), "Tensor(4, 1), int"),
])
def test_a_tuple_that_is_not_sum_and_count_is_refused(returned, shown):
    model, opt = mlp_and_sgd()

    def loss_fn(m, batch):
        logits = m(batch[0])
        return returned(torch.nn.functional.mse_loss(logits, batch[1]), logits)

    bundle = sw.pipeline(ONE)(model, opt, loss_fn=loss_fn)
    with pytest.raises(LossError) as info:
        bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    assert f"loss_fn returned a tuple ({shown}); accepted:" in str(info.value)


def test_step_refuses_an_unknown_on_nonfinite():
    model, opt = mlp_and_sgd()
    bundle = sw.pipeline(ONE)(model, opt)
    with pytest.raises(ValueError, match="'on_nonfinite' must be 'raise', 'skip' or None .got 'Skip'"):
        bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)), on_nonfinite="Skip")


def test_accumulation_windows_run_across_epoch_ends_when_asked():
    model, opt = mlp_and_sgd()
    ref = copy.deepcopy(model)
    data = SyntheticRegression(size=12)
    loader = DataLoader(data, batch_size=4)  # 3 batches an epoch
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(2, sync_with_dataloader=False))(
        model, opt, loader)
    state, seen = bundle.init(), []
    for _ in range(2):
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            seen.append((state.epoch, state.batch_in_epoch, out.stepped))
    assert seen == [(0, 1, False), (0, 2, True), (1, 0, False), (1, 1, True), (1, 2, False),
                    (2, 0, True)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    order = [range(0, 8), range(8, 12), range(0, 4), range(4, 12)]  # the three windows
    for window in (order[0], list(order[1]) + list(order[2]), order[3]):
        idx = list(window)
        ref(data.x[idx], data.y[idx]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert max_param_diff(model, ref) <= 1e-6


@pytest.mark.parametrize("weighted", [False, True], ids=["mean-loss", "token-weighted"])
def test_a_window_closes_at_the_end_of_each_epoch_normalised_by_what_it_holds(weighted):
    model, opt = mlp_and_sgd()
    ref = copy.deepcopy(model)
    data = SyntheticRegression(size=12)
    loader = DataLoader(data, batch_size=4)  # 3 batches an epoch: windows of 2, then 1

    def summed(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x), y, reduction="sum"), y.numel()

    bundle = sw.pipeline(ONE, sw.accumulate_gradients(2))(
        model, opt, loader, loss_fn=summed if weighted else None)
    assert "closes at the end of each epoch" in sw.pipeline(ONE, sw.accumulate_gradients(2)).explain()
    state, seen = bundle.init(), []
    for _ in range(2):
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            seen.append((state.epoch, state.batch_in_epoch, out.stepped))
    assert seen == [(0, 1, False), (0, 2, True), (1, 0, True), (1, 1, False), (1, 2, True),
                    (2, 0, True)]
    assert state.step == 4 and state.window_batches == 0
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window in (range(0, 8), range(8, 12)) * 2:  # the partial window: its own mean
        idx = list(window)
        ref(data.x[idx], data.y[idx]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert max_param_diff(model, ref) <= 1e-6


def empty_batch_loss(model, batch):
    """A mean over no labelled item: the loss is NaN, every gradient finite (zero)."""
    x, y = batch
    pred = model(x)
    keep = torch.zeros(len(y), dtype=torch.bool)
    return torch.nn.functional.mse_loss(pred[keep], y[keep])


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_non_finite_loss_with_finite_gradients_is_caught_like_a_gradient(policy):
    model, opt = mlp_and_sgd()
    before = copy.deepcopy(model)
    bundle = sw.pipeline(ONE, on_nonfinite=policy)(model, opt, loss_fn=empty_batch_loss)
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="non-finite loss or item count"):
            checked_step(bundle, batch)
    else:
        state, out = bundle.step(bundle.init(), batch)
        assert state.skipped_steps == 1 and not out.stepped
    assert max_param_diff(model, before) == 0.0  # nothing applied


@pytest.mark.parametrize("count, error", [(-4, LossError), (float("nan"), LossError),
                                          (torch.tensor(-4.0), NonFiniteError),
                                          (torch.tensor(float("inf")), NonFiniteError)])
def test_a_negative_or_non_finite_item_count_is_refused(count, error):
    model, opt = mlp_and_sgd()
    before = copy.deepcopy(model)

    def counted(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1], reduction="sum"), count

    bundle = sw.pipeline(ONE)(model, opt, loss_fn=counted)
    with pytest.raises(error):
        checked_step(bundle, (torch.randn(4, 8), torch.randn(4, 1)))
    assert max_param_diff(model, before) == 0.0


def test_checkpointed_transformers_layers_get_no_cache_and_train_as_without_checkpointing():
    """A Transformers Llama builds a key/value cache in training (use_cache=True in its
    config); a checkpointed layer recomputed in backward would append its keys again (with a
    padding mask that failed: 'size of tensor a (32) must match ... (16)'). Checkpointed
    layers get no cache, as under Transformers' own gradient checkpointing: the step equals
    one without checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, attn_implementation="sdpa")
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding on one sample
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}
    trained = []
    for parts in ([], [sw.checkpoint_activations()]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        bundle = sw.pipeline(sw.Env(), *parts)(model, torch.optim.SGD(model.parameters(), lr=0.1))
        bundle.step(bundle.init(), batch)
        trained.append(bundle.model)
    assert max_param_diff(*trained) < 1e-6
