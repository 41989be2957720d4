# The Trainer on shardwise in one process: what it refuses by name, what it answers of the accelerator, what a
# resume checks first.
import pytest
import torch

import shardwise as sw
from shardwise.errors import ArgumentError, EnvError

from _trainer import ZERO2, tiny_llama, token_data

transformers = pytest.importorskip("transformers")


def test_on_shardwise_refuses_what_is_not_a_trainer_and_an_untested_major_version():
    from shardwise.trainer.seam import _check_version

    with pytest.raises(ArgumentError, match="on_shardwise\\(\\) takes transformers.Trainer"):
        sw.on_shardwise(dict)
    with pytest.raises(EnvError, match=r"transformers 4.57.0 is not a tested major version .*"
                                       r"tested: 5.25"):
        _check_version("4.57.0")
    _check_version("5.30.1")  # a later minor release of a tested major is taken
    assert sw.on_shardwise(sw.Trainer) is sw.Trainer


def test_deepspeed_zero3_is_refused_under_the_trainer(tmp_path):
    pytest.importorskip("deepspeed")
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    stage3 = {**ZERO2["deepspeed"], "zero_optimization": {"stage": 3}}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             deepspeed=stage3)
    try:
        with pytest.raises(sw.errors.ConfigError, match=r"stage=3 is not supported .*zero.Init"):
            sw.Trainer(model=tiny_llama(), args=args, train_dataset=token_data(4, 1))
    finally:
        unset_hf_deepspeed_config()


def test_engines_not_run_under_the_trainer_yet_are_refused_by_name(tmp_path):
    from transformers import TrainingArguments

    argument = "fp16"
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.fp16 = True  # set after: a CPU TrainingArguments refuses fp16 itself
    with pytest.raises(sw.errors.ConfigError, match=rf"{argument}=.* is not supported by the "
                                                    r"Trainer on shardwise yet"):
        sw.Trainer(model=tiny_llama(), args=args, train_dataset=token_data(4, 1))
    assert issubclass(sw.Trainer, transformers.Trainer) and sw.Trainer.__name__ == "Trainer"


def test_a_trainingarguments_subclass_is_read_and_its_own_fields_noticed(tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_length=64,
                         gradient_accumulation_steps=2, bf16=False)
    pipe = sw.from_training_args(args, env=sw.Env())
    assert sw.accumulate_gradients(2) in pipe.transforms
    assert any("max_length" in notice and "are SFTConfig's own fields" in notice
               for notice in pipe.notes), pipe.notes


def test_the_trainers_pipeline_says_it_splits_and_seeds_loaders_as_accelerate(tmp_path):
    from transformers import TrainingArguments

    from shardwise.configured import trainer_pipeline

    pipe = trainer_pipeline(TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                              report_to=[], seed=3))
    assert sw.distribute_data(seed=3, non_blocking=False, pin_memory=False, split="batches",
                              global_seed=True) in pipe.transforms
    assert not pipe.fit_options  # the Trainer runs its own loop


def one_process_trainer(output_dir, **overrides):
    """A Trainer on shardwise in this process (world size 1): 4 optimizer steps, a
    checkpoint every 2."""
    from transformers import TrainingArguments

    args = TrainingArguments(**{
        "output_dir": str(output_dir), "per_device_train_batch_size": 2, "max_steps": 4,
        "learning_rate": 3e-3, "warmup_steps": 2, "save_strategy": "steps", "save_steps": 2,
        "report_to": [], "use_cpu": True, "seed": 7, "disable_tqdm": True,
        "dataloader_num_workers": 0, **overrides})
    return sw.Trainer(model=tiny_llama(), args=args, train_dataset=token_data(16, 1))


class Planted:
    """What a planted pickle runs when it is loaded (torch.load(weights_only=True) refuses)."""

    def __reduce__(self):
        return print, ("a planted pickle ran",)


def refused_before_loading(output_dir, checkpoint, match):
    """Resuming from ``checkpoint`` raises a CheckpointError matching ``match`` before the
    model holds a single weight of it."""
    trainer = one_process_trainer(output_dir)
    with pytest.raises(sw.errors.CheckpointError, match=match):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    fresh = tiny_llama().state_dict()
    assert all(torch.equal(value, fresh[name]) for name, value in
               trainer.model.state_dict().items())  # nothing of the checkpoint was loaded


def test_a_resume_loads_only_files_its_checksums_cover_and_checks_them_all_first(tmp_path):
    """A sealed checkpoint loads only the files its checksums.json lists: an optimizer.pt
    and scheduler.pt of step 2 planted into a save_only_model checkpoint-4, or swapped in
    after checksums.json was deleted, are refused by name. A folder the Trainer on Accelerate
    wrote (no checksums.json, no shardwise record) loads with a warning, but a pickle planted
    in its rng_state.pth is refused by name before anything is loaded."""
    import shutil

    one_process_trainer(tmp_path / "full").train()
    one_process_trainer(tmp_path / "lean", save_only_model=True).train()
    step2, step4, lean = (tmp_path / "full" / "checkpoint-2", tmp_path / "full" / "checkpoint-4",
                          tmp_path / "lean" / "checkpoint-4")
    assert not (lean / "optimizer.pt").exists()
    for name in ("optimizer.pt", "scheduler.pt"):
        shutil.copy(step2 / name, lean / name)
    refused_before_loading(tmp_path / "a", lean, r"optimizer\.pt is not listed in .*checksums\.json")

    (step4 / "checksums.json").unlink()
    shutil.copy(step2 / "optimizer.pt", step4 / "optimizer.pt")
    refused_before_loading(tmp_path / "b", step4, r"checkpoint-4/checksums\.json is missing")

    theirs = tmp_path / "theirs" / "checkpoint-2"  # as the Trainer on Accelerate writes it
    shutil.copytree(step2, theirs)
    for path in theirs.iterdir():
        if path.name not in {"config.json", "generation_config.json", "model.safetensors",
                             "optimizer.pt", "scheduler.pt", "rng_state.pth",
                             "trainer_state.json", "training_args.bin"}:
            path.unlink()  # shardwise's own files
    torch.save({"python": Planted()}, theirs / "rng_state.pth")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(theirs / "rng_state.pth", weights_only=True)
    refused_before_loading(tmp_path / "c", theirs, r"checkpoint-2/rng_state\.pth cannot be loaded")
    shutil.copy(step2 / "rng_state.pth", theirs / "rng_state.pth")
    one_process_trainer(tmp_path / "c").train(resume_from_checkpoint=str(theirs))  # unverified


def test_save_total_limit_leaves_a_checkpoint_it_cannot_delete_under_its_name(tmp_path, caplog):
    """A checkpoint made read-only (its folder, or the files in it) is left where it is under
    its own name, with a warning naming it, as the Trainer on Accelerate (whose rmtree
    cannot delete it) leaves it; it counts as deleted, as there, and the next is deleted."""
    import logging
    import os
    import stat
    import time

    run = tmp_path / "run"
    frozen, locked = run / "checkpoint-1", run / "checkpoint-0"
    for folder in (frozen, locked):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        os.utime(folder, (time.time() - 600, time.time() - 600))  # the oldest
    (locked / "model.safetensors").chmod(0o444)
    frozen.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
            one_process_trainer(run, max_steps=6, save_total_limit=2).train()
    finally:
        frozen.chmod(0o755)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == \
        ["checkpoint-0", "checkpoint-1", "checkpoint-4", "checkpoint-6"]
    assert not list(run.glob(".trash.*"))
    for folder in (frozen, locked):
        assert (folder / "model.safetensors").read_bytes() == b"weights"
        assert any(str(folder) in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records), folder
    assert stat.S_IMODE(locked.joinpath("model.safetensors").stat().st_mode) == 0o444


# -- what Transformers, TRL and PEFT ask of the Trainer's accelerator ----------------------

#: ``accelerator.<name>`` in their sources that is torch's ``torch.accelerator`` (or a file
#: name), not the Trainer's: checked by hand where it occurs
NOT_THE_TRAINERS = {"type", "py", "is_available", "current_accelerator", "synchronize",
                    "set_device_index", "device_count", "current_device_index"}


def asked_of_the_accelerator():
    """Every ``accelerator.<name>`` in the installed Transformers, TRL and PEFT sources."""
    import importlib
    import re
    from pathlib import Path

    names = {}
    pattern = re.compile(r"(?<![\w.]torch\.)(?<!torch\.)\baccelerator\.([A-Za-z_]\w*)")
    for package in ("transformers", "trl", "peft"):
        module = pytest.importorskip(package)
        root = Path(importlib.util.find_spec(module.__name__).origin).parent
        for path in root.rglob("*.py"):
            for name in pattern.findall(path.read_text(errors="replace")):
                names.setdefault(name, f"{package}/{path.relative_to(root)}")
    return names


def test_everything_transformers_trl_and_peft_ask_of_the_accelerator_is_answered_or_refused():
    """The list is read from the installed sources: a release that reaches for more fails
    here, naming the file, not in a user's run."""
    import inspect

    from shardwise.trainer.accelerator import ShardwiseAccelerator
    from shardwise.trainer.from_accelerate import REFUSED

    asked = asked_of_the_accelerator()
    assert {"print", "reduce", "split_between_processes", "gather_for_metrics",
            "maybe_context_parallel", "clear", "dataloader_config"} <= set(asked)
    source = inspect.getsource(ShardwiseAccelerator)
    unanswered = {name: where for name, where in asked.items()
                  if name not in NOT_THE_TRAINERS and name not in REFUSED
                  and not hasattr(ShardwiseAccelerator, name)
                  and not any(f"self.{name}{end}" in source for end in (" =", ":", ", "))}
    assert unanswered == {}, f"asked of the accelerator, neither answered nor refused: {unanswered}"
