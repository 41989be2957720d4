# The Trainer on shardwise against the Trainer on Accelerate: same arguments, 2 gloo ranks, same logs.
# Its tests that start no process are in tests/unit/test_trainer_seam.py.
import math

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed

from _trainer import ZERO2, tiny_llama, token_data

transformers = pytest.importorskip("transformers")


def accuracy(prediction):
    logits, labels = prediction.predictions, prediction.label_ids
    predicted = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    counted = target != -100
    return {"accuracy": float((predicted == target)[counted].mean())}


def stop_at(step):
    """A callback that stops training after optimizer step ``step`` (a crash, as far as the
    next run can tell: it resumes from the checkpoint saved there)."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return Stop()


def train(on_shardwise, output_dir, overrides, sizes=(16, 8), stop=None, resume=None,
          dropout=0.0, launch=None):
    """One Trainer run on this rank: its log history (every logging step and evaluation);
    ``launch``: the variables ``accelerate launch`` would have set."""
    import os

    from transformers import Trainer, TrainingArguments

    os.environ.update(launch or {})
    if overrides.pop("device_budget", None):  # a device too small for DDP's copy
        import shardwise.choice

        shardwise.choice.budget = lambda env: 64 * 1024
    args = TrainingArguments(**{
        "output_dir": output_dir, "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2, "num_train_epochs": 2, "learning_rate": 3e-3,
        "warmup_steps": 2, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 3,
        "save_strategy": "no", "report_to": [], "use_cpu": True, "ddp_backend": "gloo",
        "seed": 7, "disable_tqdm": True, "dataloader_num_workers": 0, **overrides})
    cls = sw.Trainer if on_shardwise else Trainer
    trainer = cls(model=tiny_llama(dropout), args=args, train_dataset=token_data(sizes[0], 1),
                  eval_dataset=token_data(sizes[1], 2), compute_metrics=accuracy,
                  callbacks=[] if stop is None else [stop_at(stop)])
    trainer.train(resume_from_checkpoint=resume)
    history = [{k: v for k, v in log.items() if k in KEPT} for log in trainer.state.log_history]
    if args.load_best_model_at_end:
        weight = trainer.model.lm_head.weight.detach()
        if hasattr(weight, "full_tensor"):  # sharded: the whole tensor, on every rank
            weight = weight.full_tensor()
        history.append({"best": int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1]),
                        "weight": float(weight.double().square().sum())})
    # what ran: shardwise's engine, or whether Accelerate ran FSDP
    engine = trainer.accelerator.bundle.engine.name if on_shardwise else \
        "FSDP2" if trainer.is_fsdp_enabled else "DDP"
    return history, type(trainer.accelerator).__name__, engine


#: what must agree at every logging step and evaluation (time and speed are left out)
KEPT = ("loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy", "epoch", "step")


def both(tmp_path, sizes=(16, 8), dropout=0.0, **overrides):
    runs = {}
    for name, on in (("accelerate", False), ("shardwise", True)):
        ranks = run_distributed(train, on, str(tmp_path / name), overrides, sizes, None, None,
                                dropout, timeout=300)
        histories = [history for history, _, _ in ranks]
        assert histories[0] == histories[1]  # every rank logs the same
        assert ranks[0][1] == ("ShardwiseAccelerator" if on else "Accelerator")
        runs[name] = histories[0]
        runs[f"{name} engine"] = ranks[0][2]
    return runs["accelerate"], runs["shardwise"], runs["shardwise engine"]


def assert_same_logs(theirs, ours, tolerance=1e-6):
    assert len(theirs) == len(ours) and len(ours) > 4
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.keys() == other.keys(), (mine, other)
        for key, value in mine.items():
            assert math.isclose(value, other[key], rel_tol=tolerance, abs_tol=tolerance), \
                (key, value, other[key], mine)


#: fsdp="full_shard" as the Trainer takes it: FSDP2 on each decoder layer, then the root
FSDP2 = {"fsdp": "full_shard auto_wrap",
         "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


#: checkpoints every 3 steps, the best one (by eval_loss) loaded at the end
BEST = {"save_strategy": "steps", "save_steps": 3, "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss"}


def test_ddp_with_dropout_uneven_data_and_the_best_model_logs_what_accelerate_logs(tmp_path):
    """DDP, and the default pipeline choosing by memory, against the Trainer on Accelerate:
    - 14 training samples in global batches of 4 and 7 evaluation samples: the last batch of
      each epoch and of the evaluation are padded as Accelerate pads them (from the epoch's
      start, every rank a full batch) and the padding is dropped from the gathered metrics;
    - dropout: each epoch's loader iteration draws its seed from torch's global stream as
      Accelerate's prepared loader does, so the masks are the same;
    - load_best_model_at_end: the same best checkpoint, the same weights loaded from it;
    - TrainingArguments that ask nothing of DDP let the pipeline choose by memory: DDP where
      the model fits (as the Trainer), FSDP2 where DDP's whole copy and its AdamW state exceed
      the budget per rank, with the same logs."""
    theirs, ours, engine = both(tmp_path, sizes=(14, 7), dropout=0.3, **BEST)
    assert engine == "DistributedDataParallel"  # it fits: DDP, as the Trainer
    assert any("eval_accuracy" in log for log in ours) and any("grad_norm" in log for log in ours)
    assert theirs[-1]["best"] == ours[-1]["best"]
    assert_same_logs(theirs, ours)
    tight = run_distributed(train, True, str(tmp_path / "tight"), {**BEST, "device_budget": True},
                            (14, 7), None, None, 0.3, timeout=300)[0]
    assert tight[2] == "FSDP2"
    assert_same_logs(theirs, tight[0])


@pytest.mark.parametrize("overrides", [{"gradient_accumulation_steps": 2, "bf16": True},
                                       {**FSDP2, **BEST, "gradient_accumulation_steps": 2}, ZERO2],
                         ids=["ddp-accumulation-bf16", "fsdp2-accumulation-best", "deepspeed-zero2"])
def test_the_trainer_on_shardwise_logs_what_it_logs_on_accelerate(tmp_path, overrides):
    """bf16 with accumulation; FSDP2 (whose best model is gathered to save and set back into
    the shards to load); DeepSpeed ZeRO-2, DeepSpeed's own engine on Accelerate and its
    native mapping on shardwise."""
    if "deepspeed" in overrides:
        pytest.importorskip("deepspeed")
    theirs, ours, engine = both(tmp_path, **overrides)
    assert engine == ("FSDP2" if "fsdp" in overrides or "deepspeed" in overrides
                      else "DistributedDataParallel")
    if "load_best_model_at_end" in overrides:
        assert theirs[-1]["best"] == ours[-1]["best"]
    assert_same_logs(theirs, ours)


@pytest.mark.parametrize("engine", [{}, FSDP2], ids=["ddp", "fsdp2"])
def test_resume_from_checkpoint_mid_epoch_continues_the_same_run(tmp_path, engine):
    """Stopped after optimizer step 5 (mid-epoch 2, a checkpoint every 5 steps) and resumed
    in new processes: the resumed run logs what the uninterrupted one logged from step 6 on.
    The resumed epoch starts part-way through its order (the uninterrupted run equals the
    Trainer on Accelerate's: the tests above)."""
    saving = {"save_strategy": "steps", "save_steps": 5, **engine}
    ours = run_distributed(train, True, str(tmp_path / "whole"), saving, timeout=300)[0][0]
    run_distributed(train, True, str(tmp_path / "cut"), saving, (16, 8), 5, timeout=300)
    resumed = run_distributed(train, True, str(tmp_path / "cut"), saving, (16, 8), None, True,
                              timeout=300)[0][0]
    after = [log for log in ours if log.get("step", 0) > 5]
    assert len(after) > 3
    assert_same_logs(after, [log for log in resumed if log.get("step", 0) > 5])


#: a checkpoint every 3 of the 8 optimizer steps, the newest 2 kept
ROTATING = {"save_strategy": "steps", "save_steps": 3, "save_total_limit": 2}


def crashing_in_save(step, *args):
    """``train(*args)``, rank 1 killed inside the Trainer's save at optimizer step ``step``,
    after rank 0 has written the model and optimizer into the checkpoint."""
    import os

    from transformers import Trainer

    original = Trainer._save_rng_state

    def dying(self, output_dir):
        if self.state.global_step == step and self.args.process_index == 1:
            os._exit(3)
        original(self, output_dir)

    Trainer._save_rng_state = dying
    return train(*args)


def locked_out(*args):
    """``train(*args)`` whose saves wait half a second for another writer."""
    from shardwise.checkpoint import lock

    lock.WAIT_SECONDS = 0.5
    return train(*args)


def sealed_checkpoints(run_dir):
    """The checkpoint folders under ``run_dir``, each checked to list every file it holds
    in its checksums.json."""
    import json

    found = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for folder in found:
        listed = set(json.loads((folder / "checksums.json").read_text())["files"])
        held = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        assert listed == held - {"checksums.json"} and "model.safetensors" in listed, folder
    assert not list(run_dir.glob(".tmp.*")) and not list(run_dir.glob(".trash.*"))
    return [p.name for p in found]


def test_the_trainers_checkpoints_are_transactions(tmp_path):
    """The Trainer's checkpoint-N folders are saved as sw.save saves (sealed, published in
    one rename, rotated as the Trainer rotates): a rank killed mid-save leaves no
    checkpoint-N, and resuming continues from the last published one as the uninterrupted
    run; a damaged file is refused by name; a second writer on the output_dir is refused
    naming the holder, before anything is written."""
    import signal
    import subprocess
    import sys

    from shardwise.errors import RankFailedError

    whole = run_distributed(train, True, str(tmp_path / "whole"), ROTATING, timeout=300)[0][0]
    run_distributed(train, False, str(tmp_path / "theirs"), ROTATING, timeout=300)
    kept = sealed_checkpoints(tmp_path / "whole")
    assert kept == sorted(p.name for p in (tmp_path / "theirs").glob("checkpoint-*")) \
        == ["checkpoint-6", "checkpoint-8"]

    cut = tmp_path / "cut"
    with pytest.raises(RankFailedError):
        run_distributed(crashing_in_save, 6, True, str(cut), ROTATING, timeout=300)
    assert (cut / ".tmp.checkpoint-6" / "checkpoint-6" / "model.safetensors").is_file()
    assert sorted(p.name for p in cut.glob("checkpoint-*")) == ["checkpoint-3"]
    resumed = run_distributed(train, True, str(cut), ROTATING, (16, 8), None, True,
                              timeout=300)[0][0]
    assert_same_logs([log for log in whole if log.get("step", 0) > 3],
                     [log for log in resumed if log.get("step", 0) > 3])
    assert sealed_checkpoints(cut) == kept  # the debris cleared by the next save

    weights = tmp_path / "whole" / "checkpoint-8" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(RankFailedError, match="model.safetensors does not match its checksum"):
        run_distributed(train, True, str(tmp_path / "whole"), ROTATING, (16, 8), None, True,
                        timeout=300)

    held = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from shardwise.checkpoint import lock; "
                               "lock.acquire(Path(sys.argv[1])); print('held', flush=True); "
                               "time.sleep(120)", str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RankFailedError, match=rf"the last writer was pid {holder.pid}"):
            run_distributed(locked_out, True, str(held), ROTATING, timeout=300)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not list(held.glob("*checkpoint-*"))


def test_tensor_parallel_from_parallelism_config_equals_ddp_on_accelerate(tmp_path):
    """``parallelism_config={"tp_size": 2}`` on 2 CPU ranks (Accelerate refuses tensor
    parallelism off CUDA): one tensor-parallel group reading the global batch of 4 logs what
    the Trainer on Accelerate logs with DDP over 2 ranks of 2 samples, and its checkpoints
    gather the split layers whole."""
    theirs = run_distributed(train, False, str(tmp_path / "ddp"), {}, timeout=300)[0][0]
    tensor = {"parallelism_config": {"tp_size": 2}, "per_device_train_batch_size": 4,
              "per_device_eval_batch_size": 4, "save_strategy": "steps", "save_steps": 4}
    ranks = run_distributed(train, True, str(tmp_path / "tp"), tensor, timeout=300)
    assert ranks[0][0] == ranks[1][0]
    assert_same_logs(theirs, ranks[0][0], tolerance=1e-5)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "tp" / "checkpoint-4" / "model.safetensors"))
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (16, 16)  # whole


#: what `accelerate launch --config_file` sets for an FSDP2 config (Accelerate 1.16), fp32
LAUNCHED_FSDP2 = {
    "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "false"}


def test_a_trainer_started_by_accelerate_launch_takes_its_config_as_on_accelerate(tmp_path):
    """TrainingArguments without fsdp, in processes ``accelerate launch`` started with an
    FSDP2 config: the Trainer on shardwise shards as that config says. On CPU ranks the
    Trainer on Accelerate silently runs DDP instead (its state takes ACCELERATE_USE_FSDP on
    accelerators only); the logs agree all the same, FSDP2 computing what DDP does."""
    runs = {}
    for name, on in (("accelerate", False), ("shardwise", True)):
        ranks = run_distributed(train, on, str(tmp_path / name), {}, (16, 8), None, None, 0.0,
                                LAUNCHED_FSDP2, timeout=300)
        runs[name] = ranks[0]
    assert runs["shardwise"][2] == "FSDP2" and runs["accelerate"][2] == "DDP"
    assert_same_logs(runs["accelerate"][0], runs["shardwise"][0])


def trainer_refusal(output_dir, overrides):
    """On this rank: the ConfigError a Trainer on shardwise raises for ``overrides``."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[],
                             ddp_backend="gloo", **overrides)
    try:
        sw.Trainer(model=tiny_llama(), args=args, train_dataset=token_data(4, 1))
    except sw.errors.ConfigError as exc:
        return str(exc)
    return "no error"


def test_context_parallel_is_refused_under_the_trainer(tmp_path):
    """The Trainer's compute_loss runs the model on whole sequences, which context_parallel
    would split without shifting the labels: refused by name on 2 ranks (sw.fit runs it)."""
    said = run_distributed(trainer_refusal, str(tmp_path), {"parallelism_config": {"cp_size": 2}},
                           timeout=300)
    for message in said:
        assert "cp_size/sp_size is not supported by the Trainer on shardwise yet" in message


# -- what Transformers, TRL and PEFT ask of the Trainer's accelerator ----------------------

def surface(output_dir):
    """A 2-rank sw.Trainer: Accelerate's helpers TRL calls, the accelerator's answers, and a
    TRL script's last lines (``accelerator.print`` then ``save_model``)."""
    import contextlib
    import io

    from accelerate.state import AcceleratorState
    from accelerate.utils import broadcast_object_list, gather, gather_object
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2,
                             num_train_epochs=1, save_strategy="no", report_to=[], use_cpu=True,
                             ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0)
    trainer = sw.Trainer(model=tiny_llama(), args=args, train_dataset=token_data(8, 1))
    rank = torch.distributed.get_rank()
    acc = trainer.accelerator
    out = {"objects": gather_object([f"rank{rank}"]),
           "broadcast": broadcast_object_list([rank * 10 + 1]),
           "gathered": gather(torch.tensor([float(rank)])).tolist(),
           "sum": acc.reduce(torch.tensor([rank + 1.0])).item(),
           "mean": acc.reduce({"x": torch.tensor([rank + 1.0])}, reduction="mean")["x"].item()}
    with acc.split_between_processes(list(range(5))) as part:
        out["split"] = part
    trainer.train()
    state = AcceleratorState()
    out.update(wrapped=type(trainer.model_wrapped).__name__,
               accelerate=(state.mixed_precision, getattr(state, "fsdp_plugin", None),
                           state.deepspeed_plugin, str(state.distributed_type)),
               precision=acc.mixed_precision, mesh=acc.torch_device_mesh is None)
    with acc.maybe_context_parallel(buffers=[]):
        pass
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        acc.print("saving the model")  # TRL's scripts, just before save_model
    out["printed"] = printed.getvalue()
    trainer.save_model(f"{output_dir}/final")
    try:
        out["refused"] = getattr(acc, "deepspeed_ulysses_dl_adapter")  # noqa: B009
    except AttributeError as exc:
        out["refused"] = str(exc)
    return out


def test_trls_accelerate_helpers_and_scripts_last_lines_work_on_shardwise(tmp_path):
    """Accelerate's gather_object / broadcast_object_list / gather (which need its state)
    work from the process group shardwise runs; nothing of Accelerate's wraps or casts."""
    from transformers import LlamaForCausalLM

    runs = run_distributed(surface, str(tmp_path), world_size=2)
    for rank, got in enumerate(runs):
        assert got["objects"] == ["rank0", "rank1"]
        assert got["broadcast"] == [1]
        assert got["gathered"] == [0.0, 1.0]
        assert (got["sum"], got["mean"]) == (3.0, 1.5)
        assert got["split"] == ([0, 1, 2] if rank == 0 else [3, 4])
        assert got["wrapped"] == "DistributedDataParallel"  # shardwise's replicate()
        assert got["accelerate"] == ("no", None, None, "DistributedType.MULTI_CPU")
        assert got["precision"] == "no" and got["mesh"]
        assert got["printed"] == ("saving the model\n" if rank == 0 else "")
        assert "Ulysses sequence parallelism" in got["refused"]
    LlamaForCausalLM.from_pretrained(tmp_path / "final")
