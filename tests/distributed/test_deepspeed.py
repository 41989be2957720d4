# sw.deepspeed(config): DeepSpeed's own engine on 2 CPU ranks (gloo), against one process.
# Its tests that start no process are in tests/unit/test_deepspeed_pipeline.py.
"""ZeRO 1-3 in fp32 and bf16, optimizer offload and accumulation run by DeepSpeed itself on
two real ranks, each compared with one process training the same global batches (the
``"auto"`` resolution and every contradiction with the pipeline are checked in one process,
in tests/unit).

Skipped, with the reason, where ``import deepspeed`` fails (install ``shardwise[deepspeed]``).
DeepSpeed compiles a small communication op on first use (about a minute, once per
``TORCH_EXTENSIONS_DIR``; the Makefile keeps it in the venv).
"""
import os

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import CheckpointError, LossError, NonFiniteError
from shardwise.testing import SyntheticTokens, full_state, run_distributed

from _checkpointing import Payload
from _deepspeed import FP32, _loader, _model, needs_deepspeed

STEPS = 8  # micro-batches: 4 optimizer steps of 2


def _train(bundle):
    state, losses = bundle.init(), []
    while state.micro_step < STEPS:
        for batch in bundle.loader:
            state, out = bundle.step(state, batch)
            losses.append(float(out.loss))
            if state.micro_step == STEPS:
                break
    return state, losses


def _optimizer(model, precision):
    """SGD with momentum for the fp32 parity runs (Adam divides by the gradients' size, so it
    magnifies fp32 rounding in near-zero gradients to ~1e-5: measured 1.2e-5 at ZeRO-1, where
    SGD agrees to 3e-8); AdamW for bf16."""
    if precision == "fp32":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reference(precision="fp32", clip=None):
    """One process on the global batch of 8, windows of 2."""
    parts = [sw.accumulate_gradients(2), sw.mixed_precision(precision)]
    if clip:
        parts.append(sw.clip_gradients(clip))
    model = _model()
    bundle = sw.pipeline(sw.Env(), *parts)(model, _optimizer(model, precision), _loader(8))
    state, losses = _train(bundle)
    return state, losses, full_state(bundle.model)


def _full_params(bundle):
    """Every parameter whole (gathered under ZeRO-3), fp32, by name."""
    import deepspeed

    module = bundle.model.module
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _held(bundle):
    """Optimizer-state elements (fp32 master partition) and parameter elements this rank holds."""
    ds = bundle.model
    params = list(ds.module.parameters())
    if hasattr(params[0], "ds_tensor"):  # ZeRO-3: each rank holds a partition of each parameter
        held = sum(p.ds_tensor.numel() for p in params)
        return held, held
    fp32 = getattr(ds.optimizer, "single_partition_of_fp32_groups", None)
    opt = sum(t.numel() for t in fp32) if fp32 is not None else sum(p.numel() for p in params)
    return opt, sum(p.numel() for p in params)


CASES = {
    "zero1_fp32": {**FP32},
    "zero2_fp32": {**FP32, "zero_optimization": {"stage": 2}},
    "zero3_fp32": {**FP32, "zero_optimization": {"stage": 3}},
    "zero2_fp32_clip": {**FP32, "zero_optimization": {"stage": 2}},
    "zero2_fp32_offload": {**FP32, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero1_bf16": {**FP32},
    "zero2_bf16_clip": {**FP32, "zero_optimization": {"stage": 2}},
    "zero3_bf16": {**FP32, "zero_optimization": {"stage": 3}},
}
PRECISION = {"zero1_bf16": "bf16", "zero2_bf16_clip": "bf16", "zero3_bf16": "bf16"}
CLIP = {"zero2_bf16_clip": 0.5, "zero2_fp32_clip": 0.05}


def _run_cases():
    out = {}
    for name, config in CASES.items():
        parts = [sw.deepspeed(config), sw.accumulate_gradients(2),
                 sw.mixed_precision(PRECISION.get(name, "fp32"))]
        if name in CLIP:
            parts.append(sw.clip_gradients(CLIP[name]))
        model = _model()
        total = sum(p.numel() for p in model.parameters())  # ZeRO-3 empties them
        bundle = sw.pipeline(sw.detect(), *parts)(
            model, _optimizer(model, PRECISION.get(name, "fp32")), _loader(4))
        state, losses = _train(bundle)
        out[name] = (state, losses, _full_params(bundle), _held(bundle), total)
    # the same configs mapped onto the native engines (the default engine)
    for stage in (1, 3):
        model = _model()
        native = sw.from_config({**FP32, "zero_optimization": {"stage": stage},
                                 "gradient_accumulation_steps": 2}, env=sw.detect())
        bundle = native(model, _optimizer(model, "fp32"), _loader(4))
        _train(bundle)
        out[f"native_zero{stage}"] = full_state(bundle.model)
    # the engine chosen from a config file
    model = _model()
    pipe = sw.from_config({**FP32, "gradient_accumulation_steps": 2}, engine="deepspeed")
    bundle = pipe(model, _optimizer(model, "fp32"), _loader(4))
    state, losses = _train(bundle)
    out["from_config"] = (state, losses, _full_params(bundle), _held(bundle),
                          sum(p.numel() for p in _model().parameters()))
    # what is not supported is refused, naming what to do
    for name, loss_fn, error in (
            ("weighted", lambda m, b: (m(**b)["loss"] * 4, 4), LossError),
            ("nan", lambda m, b: m(**b)["loss"] * float("nan"), NonFiniteError)):
        model = _model()
        bundle = sw.pipeline(sw.detect(), sw.deepspeed(FP32))(
            model, torch.optim.AdamW(model.parameters()), _loader(4), loss_fn=loss_fn)
        before = {k: v.clone() for k, v in _full_params(bundle).items()}
        try:
            bundle.step(bundle.init(), next(iter(bundle.loader)))
        except error as exc:
            after = _full_params(bundle)
            out[name] = (str(exc), all(torch.equal(before[k], after[k]) for k in before))
    return out


@needs_deepspeed
def test_zero_stages_on_two_ranks_match_one_process():
    ranks = run_distributed(_run_cases, timeout=600)
    reference = {p: _reference(p) for p in ("fp32", "bf16")}
    reference["bf16 clip"] = _reference("bf16", clip=0.5)
    reference["fp32 clip"] = _reference("fp32", clip=0.05)  # SGD: clipping shows exactly
    for name in [*CASES, "from_config"]:
        precision = PRECISION.get(name, "fp32")
        key = f"{precision} clip" if name in CLIP else precision
        want_state, want_losses, want = reference[key]
        for rank in range(2):
            state, losses, got, (opt_held, param_held), total = ranks[rank][name]
            assert state.step == want_state.step == 4 and state.micro_step == STEPS, name
            worst = max((got[k] - want[k].float()).abs().max().item() for k in want)
            # fp32 (SGD): DeepSpeed's reduction order only, measured 3e-8..1.2e-7. bf16 (AdamW,
            # lr 1e-2, 4 steps): DeepSpeed keeps bf16 parameters where one process keeps fp32
            # ones, measured 0.023-0.024 (docs/deepspeed.md)
            assert worst < (1e-6 if precision == "fp32" else 3e-2), (name, worst)
            if name.startswith(("zero1", "zero2")) and "offload" not in name:
                assert opt_held <= total / 2 + 64, (name, opt_held, total)  # optimizer sharded
            if name.startswith("zero3"):
                assert param_held <= total / 2 + 64, (name, param_held, total)  # params sharded
        # each rank reports its own micro-batch's loss; their mean is the global batch's
        mean = [(a + b) / 2 for a, b in zip(ranks[0][name][1], ranks[1][name][1], strict=True)]
        assert max(abs(a - b) for a, b in zip(mean, want_losses, strict=True)) < (
            1e-5 if precision == "fp32" else 5e-2), (name, mean, want_losses)
    for stage in (1, 3):  # DeepSpeed's engine against the native mapping of its config
        native, deepspeed_ = ranks[0][f"native_zero{stage}"], ranks[0][f"zero{stage}_fp32"][2]
        worst = max((deepspeed_[k] - native[k].float()).abs().max().item() for k in native)
        assert worst < 1e-6, (stage, worst)
    for rank in range(2):
        message, unchanged = ranks[rank]["weighted"]
        assert "loss_fn returns a mean loss" in message and unchanged
        message, unchanged = ranks[rank]["nan"]  # seen on every rank, nothing applied
        assert "non-finite loss at optimizer step 1 (micro-step 1)" in message and unchanged


def own_scheduler_steps():
    """DeepSpeed's own scheduler, built from the config with its "auto" totals filled (in a
    process of its own: DeepSpeed starts a process group)."""
    config = {"train_micro_batch_size_per_gpu": "auto", "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                            "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}}
    model = _model()
    bundle = sw.pipeline(sw.Env(), sw.deepspeed(config, epochs=2, warmup=0.25))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loader(4))
    scheduler = bundle.engine.ds.lr_scheduler
    return scheduler.total_num_steps, scheduler.warmup_num_steps


def test_deepspeeds_own_scheduler_runs_the_auto_total_from_the_run():
    pytest.importorskip("deepspeed")
    # 32 samples in batches of 4: 8 optimizer steps an epoch, 2 epochs, a quarter warm-up
    assert run_distributed(own_scheduler_steps, world_size=1, timeout=180) == [(16, 4)]


RESUMED = {"zero2_bf16": ({**FP32, "zero_optimization": {"stage": 2}}, "bf16"),
           "zero3_fp32": ({**FP32, "zero_optimization": {"stage": 3}}, "fp32")}


def _resume_run(root, micro_steps, fresh):
    """Train each case to ``micro_steps``, resuming from ``root/<case>`` unless ``fresh``; save
    at the end and export."""
    import safetensors.torch

    out = {}
    for name, (config, precision) in RESUMED.items():
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        bundle = sw.pipeline(sw.detect(), sw.deepspeed(config), sw.accumulate_gradients(2),
                             sw.mixed_precision(precision))(model, optimizer, _loader(4),
                                                            scheduler=scheduler)
        state = bundle.init() if fresh else sw.load(os.path.join(root, name), bundle)
        while state.micro_step < micro_steps:
            for batch in bundle.loader:
                state, _ = bundle.step(state, batch)
                if state.micro_step == micro_steps:
                    break
        sw.save(os.path.join(root, name), bundle, state)
        sw.export(os.path.join(root, f"{name}_export"), bundle)
        exported = safetensors.torch.load_file(os.path.join(root, f"{name}_export",
                                                            "model.safetensors"))
        out[name] = (state, _full_params(bundle), exported, scheduler.get_last_lr())
    return out


@needs_deepspeed
def test_save_load_resume_in_new_processes_is_bit_exact_and_export_gathers(tmp_path):
    whole = run_distributed(_resume_run, str(tmp_path / "whole"), STEPS, True, timeout=600)
    run_distributed(_resume_run, str(tmp_path / "split"), STEPS // 2, True, timeout=600)
    resumed = run_distributed(_resume_run, str(tmp_path / "split"), STEPS, False, timeout=600)
    for name, (_, precision) in RESUMED.items():
        for rank in range(2):
            state, params, exported, lr = whole[rank][name]
            got_state, got, got_exported, got_lr = resumed[rank][name]
            assert got_state == state and state.step == 4, name
            assert all(torch.equal(got[k], params[k]) for k in params), name
            assert got_lr == lr == [pytest.approx(1e-2 * 0.9**4)], name  # once per step
        _, params, exported, _ = whole[0][name]
        assert sorted(exported) == sorted(params)  # clean names, every tensor
        for key, value in params.items():  # the fp32 master weights, gathered
            assert exported[key].dtype == torch.float32
            bound = 0 if precision == "fp32" else 2 ** -7 * value.abs().max().item() + 1e-6
            assert (exported[key] - value).abs().max().item() <= bound, (name, key)
    path = tmp_path / "split" / "zero3_fp32" / "step_00000004"
    assert sorted(p.name for p in (path / "deepspeed").iterdir())  # DeepSpeed's own files
    assert "deepspeed/" in (path / "checksums.json").read_text()  # ... verified on load
    model = _model()  # a checkpoint of one engine is refused by a bundle of the other
    native = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters()), _loader(8))
    with pytest.raises(CheckpointError, match="written by the deepspeed engine, this bundle "
                                              "runs the torch engine"):
        sw.load(path, native)


def _load_tampered(root):
    config, precision = RESUMED["zero3_fp32"]
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)  # as saved
    bundle = sw.pipeline(sw.detect(), sw.deepspeed(config), sw.accumulate_gradients(2),
                         sw.mixed_precision(precision))(
        model, optimizer, _loader(4), scheduler=scheduler)
    try:
        sw.load(root, bundle)
    except CheckpointError as exc:
        return str(exc)
    return None


@needs_deepspeed
def test_sw_load_refuses_a_planted_pickle_before_deepspeed_reads_it(tmp_path):
    import json
    import shutil

    from shardwise.checkpoint import integrity as _integrity

    run_distributed(_resume_run, str(tmp_path / "run"), STEPS // 2, True, timeout=600)
    step = tmp_path / "run" / "zero3_fp32" / "step_00000002"
    target = sorted((step / "deepspeed").glob("*model_states.pt"))[0]
    torch.save({"module": Payload(tmp_path / "ran")}, target)
    manifest = json.loads((step / "checksums.json").read_text())  # resealed, as a forger would
    manifest["files"][str(target.relative_to(step))] = _integrity._digest(target)
    manifest["sealed"] = _integrity._sealed(manifest["files"])
    (step / "checksums.json").write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "run" / "zero2_bf16")
    messages = run_distributed(_load_tampered, str(step), timeout=600)
    for message in messages:
        assert message is not None and f"{target.name} is refused: it names" in message
    assert not (tmp_path / "ran").exists()  # nothing ran, on any rank



def _epoch_ends():
    """5 micro-batches an epoch, windows of 2: DeepSpeed's windows close at each epoch end
    (2, 2, 1), the short one normalised by what it holds; and one process alone."""
    out = {}
    for name, size in (("epoch_ends", 40),):
        model = _model()
        bundle = sw.pipeline(sw.detect(), sw.deepspeed(FP32), sw.accumulate_gradients(2),
                             sw.mixed_precision("fp32"))(
            model, _optimizer(model, "fp32"),
            DataLoader(SyntheticTokens(size=size, seq_len=8), batch_size=4, shuffle=True))
        state = bundle.init()
        for _ in range(2):
            for batch in bundle.loader:
                state, _ = bundle.step(state, batch)
        out[name] = (state, _full_params(bundle))
    return out


def _one_process_deepspeed():
    """ZeRO-2 with optimizer offload in a single process (no launcher), and a tied model's
    export."""
    import safetensors.torch

    model = _model()
    model.head.weight = model.embed.weight  # tied, as GPT-2 and Llama heads are
    bundle = sw.pipeline(sw.detect(), sw.deepspeed({**FP32, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}))(
        model, torch.optim.AdamW(model.parameters()), _loader(4))
    state, _ = _train(bundle)
    sw.export("one_export", bundle)
    exported = safetensors.torch.load_file("one_export/model.safetensors")
    return state, {k: tuple(v.shape) for k, v in exported.items()}, \
        torch.equal(exported["head.weight"], exported["embed.weight"])


@needs_deepspeed
def test_windows_close_at_epoch_ends_and_one_process_runs(tmp_path, monkeypatch):
    [got] = run_distributed(_epoch_ends, timeout=600)[:1]
    state, params = got["epoch_ends"]
    model = _model()
    bundle = sw.pipeline(sw.Env(), sw.accumulate_gradients(2), sw.mixed_precision("fp32"))(
        model, _optimizer(model, "fp32"),
        DataLoader(SyntheticTokens(size=40, seq_len=8), batch_size=8, shuffle=True))
    want = bundle.init()
    for _ in range(2):
        for batch in bundle.loader:
            want, _ = bundle.step(want, batch)
    assert state == want and state.step == 6  # 3 windows an epoch
    expected = full_state(bundle.model)
    assert max((params[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    monkeypatch.chdir(tmp_path)
    [(state, shapes, tied)] = run_distributed(_one_process_deepspeed, world_size=1, timeout=600)
    assert state.step == STEPS  # no accumulation: one optimizer step a micro-batch
    assert shapes["head.weight"] == shapes["embed.weight"] == (32, 16) and tied
