# The default step reads nothing on the host it has just computed (one process); a late check names the step.
import copy

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import NonFiniteError
from shardwise.testing import SyntheticRegression, TinyMLP, full_state, max_param_diff

from conftest import ONE, lm_and_adamw, nan_loss, reads_per_call, token_batches


def test_the_default_step_reads_only_the_previous_steps_flag():
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(2))(model, opt)
    assert opt.param_groups[0]["fused"] is True
    calls, state = reads_per_call(bundle, token_batches(8))
    assert state.step == 4 and [c[0] for c in calls] == [False, True] * 4
    # micro-steps: nothing; each call after an optimizer step: that step's flag, once
    assert [c[2] for c in calls] == [0] * 8
    assert [c[1] for c in calls] == [0, 0, 1, 0, 1, 0, 1, 0]


def test_the_counter_sees_a_read_where_one_happens():
    # "skip" decides on the host at the step: the same counter must see that read (SGD's
    # for-loop, kept under "skip", reads nothing itself)
    model, _ = lm_and_adamw()
    bundle = sw.pipeline(ONE, on_nonfinite="skip")(model, torch.optim.SGD(model.parameters(),
                                                                          lr=0.1))
    calls, _ = reads_per_call(bundle, token_batches(3))
    assert [c[2] for c in calls] == [1, 1, 1]
    # so does an optimizer whose implementation the user chose (SGD's for-loop reads nothing
    # itself; torch's for-loop and foreach AdamW read each parameter's step count too)
    model, _ = lm_and_adamw()
    bundle = sw.pipeline(ONE)(model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False))
    calls, _ = reads_per_call(bundle, token_batches(3))
    assert [c[2] for c in calls] == [1, 1, 1]


def test_clipping_reads_nothing_either():
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE, sw.clip_gradients(0.1))(model, opt)
    calls, _ = reads_per_call(bundle, token_batches(4))
    assert [c[2] for c in calls] == [0] * 4 and [c[1] for c in calls] == [0, 1, 1, 1]


def test_a_fused_sgd_with_momentum_reads_its_first_step_until_buffers_exist():
    # torch's fused SGD leaves new momentum buffers uninitialised when it skips
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)  # the user's
    bundle = sw.pipeline(ONE)(model, opt)
    batches = list(DataLoader(SyntheticRegression(size=16), batch_size=4))
    calls, _ = reads_per_call(bundle, batches)
    assert [c[2] for c in calls] == [1, 0, 0, 0]


def scaled(batches, bad_at):
    return [{**b, "scale": torch.tensor(float("nan") if i == bad_at else 1.0)}
            for i, b in enumerate(batches)]


def test_a_late_check_names_the_step_and_leaves_parameters_and_optimizer_untouched():
    model, opt = lm_and_adamw()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    bundle = sw.pipeline(ONE)(model, opt, scheduler=sched, loss_fn=nan_loss)
    batches = scaled(token_batches(4), bad_at=2)
    state = bundle.init()
    for batch in batches[:2]:
        state, _ = bundle.step(state, batch)
    weights, moments = full_state(model), copy.deepcopy(opt.state_dict()["state"])
    state, out = bundle.step(state, batches[2])  # the NaN step: skipped on the device
    assert state.pending_check is not None and state.pending_check.step == 3
    assert max_param_diff(model, weights) == 0.0
    assert all(torch.equal(moments[i][k], v) for i, s in opt.state_dict()["state"].items()
               for k, v in s.items())
    with pytest.raises(NonFiniteError, match=r"optimizer step 3 \(micro-step 3\).*skipped on the "
                       r"device.*\(the scheduler had stepped\); seen at micro-step 4"):
        bundle.step(state, batches[3])
    assert max_param_diff(model, weights) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_the_last_step_of_a_loop_is_checked_by_save_fit_and_check(tmp_path):
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE)(model, opt, loss_fn=nan_loss)
    state = bundle.init()
    for batch in scaled(token_batches(3), bad_at=2):
        state, _ = bundle.step(state, batch)
    with pytest.raises(NonFiniteError, match="optimizer step 3 "):
        sw.save(tmp_path / "ckpt", bundle, state)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    with pytest.raises(NonFiniteError, match="optimizer step 3 "):
        bundle.check(state)
    # sw.fit checks its last step before it evaluates and saves
    model, opt = lm_and_adamw()
    loader = scaled(token_batches(3), bad_at=2)
    bundle = sw.pipeline(ONE)(model, opt, loader, loss_fn=nan_loss)
    with pytest.raises(NonFiniteError, match="optimizer step 3 "):
        sw.fit(bundle, steps=3, checkpoint_dir=tmp_path / "fit", progress=False)
    assert not (tmp_path / "fit").exists() or not any((tmp_path / "fit").glob("step_*"))


def test_an_epochs_last_step_is_checked_at_once():
    model, opt = lm_and_adamw()
    loader = DataLoader(scaled(token_batches(3), bad_at=2), batch_size=None)
    bundle = sw.pipeline(ONE)(model, opt, loader, loss_fn=nan_loss)
    state, seen = bundle.init(), 0
    with pytest.raises(NonFiniteError, match=r"optimizer step 3 \(micro-step 3\).*nothing was "
                       "applied"):
        for batch in bundle.loader:
            state, _ = bundle.step(state, batch)
            seen += 1
    assert seen == 2


def adam_state(opt):
    return {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


def test_clipping_with_a_non_finite_loss_leaves_everything_untouched():
    # a NaN loss makes both the norm and the loss flag bad: the flag must still be exactly 1
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE, sw.clip_gradients(1.0))(model, opt, loss_fn=nan_loss)
    batches = scaled(token_batches(3), bad_at=1)
    state, _ = bundle.step(bundle.init(), batches[0])
    weights, moments = full_state(model), adam_state(opt)
    state, _ = bundle.step(state, batches[1])
    assert max_param_diff(model, weights) == 0.0
    after = adam_state(opt)
    assert all(torch.equal(after[k], v) for k, v in moments.items())
    with pytest.raises(NonFiniteError, match="optimizer step 2 "):
        bundle.check(state)


def test_a_caught_late_error_gives_the_state_to_continue_from():
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE)(model, opt, loss_fn=nan_loss)
    state, raised = bundle.init(), 0
    for batch in scaled(token_batches(6), bad_at=2):
        try:
            state, _ = bundle.step(state, batch)
        except NonFiniteError as exc:
            raised += 1
            state = exc.state
    assert raised == 1 and state.skipped_steps == 1 and state.step == 5
    assert bundle.check(state).step == 5


def test_a_checkpoint_of_another_implementation_keeps_the_running_one(tmp_path):
    model, _ = lm_and_adamw()
    mine = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    bundle = sw.pipeline(ONE)(model, mine)
    state, _ = bundle.step(bundle.init(), token_batches(1)[0])
    sw.save(tmp_path, bundle, state)
    model, opt = lm_and_adamw()  # the default: switched to fused
    fused = sw.pipeline(ONE)(model, opt)
    state = sw.load(tmp_path, fused)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    state, _ = fused.step(state, token_batches(2)[1])  # steps, late check and all
    assert fused.check(state).step == 2
    # and the reverse: a fused checkpoint does not switch an implementation the user chose
    sw.save(tmp_path / "fused", fused, state)
    model, _ = lm_and_adamw()
    mine = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    again = sw.pipeline(ONE)(model, mine)
    sw.load(tmp_path / "fused", again)
    assert mine.param_groups[0]["fused"] is None and mine.param_groups[0]["foreach"] is False


def test_sgd_with_momentum_keeps_its_implementation_and_trains_a_late_parameter():
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = sw.pipeline(ONE)
    assert "keeps its implementation (SGD with momentum)" in pipe.explain(model, opt)
    bundle = pipe(model, opt)
    assert opt.param_groups[0]["fused"] is None
    model.fc2.bias.requires_grad_(False)  # trained only from the second step on
    state, _ = bundle.step(bundle.init(), (torch.randn(4, 8), torch.randn(4, 1)))
    model.fc2.bias.requires_grad_(True)
    state, _ = bundle.step(state, (torch.randn(4, 8), torch.randn(4, 1)))
    assert state.step == 2 and "momentum_buffer" in opt.state[model.fc2.bias]


def test_explain_names_what_the_step_does_with_the_optimizer():
    model, opt = lm_and_adamw()
    assert "AdamW runs torch's fused kernel" in sw.pipeline(ONE).explain(model, opt)
    two = sw.Env(world_size=2, local_world_size=2)
    text = sw.pipeline(two, sw.replicate(), sw.shard_optimizer()).explain(model, opt)
    assert "keeps its implementation under shard_optimizer()" in text
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "FSDP2's DTensor parameters" in sw.pipeline(two, sw.shard()).explain(model, sgd)


def test_an_error_raised_at_the_step_gives_the_state_to_continue_from_too():
    # no fused kernel: the step that saw the value raises itself, its window already cleared
    model, _ = lm_and_adamw()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    bundle = sw.pipeline(ONE, sw.accumulate_gradients(2))(model, opt, loss_fn=nan_loss)
    state, raised = bundle.init(), []
    for batch in scaled(token_batches(6), bad_at=3):
        try:
            state, _ = bundle.step(state, batch)
        except NonFiniteError as exc:
            raised.append(exc.state)
            state = exc.state
    assert len(raised) == 1 and raised[0].window_batches == 0
    assert (state.step, state.micro_step, state.skipped_steps) == (3, 6, 1)


def test_skip_and_fp16_pipelines_leave_the_optimizer_alone():
    model, opt = lm_and_adamw()
    pipe = sw.pipeline(ONE, on_nonfinite="skip")
    assert "keeps its implementation: under on_nonfinite='skip'" in pipe.explain(model, opt)
    pipe(model, opt)
    assert opt.param_groups[0]["fused"] is None
    model, opt = lm_and_adamw()
    sw.pipeline(sw.Env(precisions=("fp32", "bf16", "fp16")), sw.mixed_precision("fp16"))(model, opt)
    assert opt.param_groups[0]["fused"] is None


def test_a_subclass_is_not_switched_and_explain_says_how_to_get_the_kernel():
    class MyAdamW(torch.optim.AdamW):
        pass

    model, _ = lm_and_adamw()
    opt = MyAdamW(model.parameters(), lr=1e-2)
    assert "MyAdamW, a subclass, is not switched" in sw.pipeline(ONE).explain(model, opt)
    sw.pipeline(ONE)(model, opt)
    assert opt.param_groups[0]["fused"] is None


def test_step_and_check_refuse_what_is_not_a_train_state():
    model, opt = lm_and_adamw()
    bundle = sw.pipeline(ONE)(model, opt)
    for call in (lambda: bundle.check({"step": 0}), lambda: bundle.step(None, token_batches(1)[0])):
        with pytest.raises(sw.errors.ArgumentError, match="'state' must be a TrainState .* got"):
            call()
