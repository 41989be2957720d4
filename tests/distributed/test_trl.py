# TRL's trainers and scripts on shardwise against the same on Accelerate: 2 gloo ranks, same logs.

import re
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import KEPT, assert_same_logs

import shardwise as sw
from shardwise.testing import free_port, run_distributed

from _jobs import run_jobs
from _trainer import LENGTH, VOCAB, tiny_llama

pytest.importorskip("trl")
pytest.importorskip("peft")


def word_tokenizer():
    """A tokenizer of the tiny vocabulary, built offline (TRL's trainer needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t1 t2" is two tokens
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")



def sft(on_shardwise, output_dir, samples=16, kept=KEPT):
    """TRL's SFTTrainer fine-tuning a LoRA adapter (PEFT) on pre-tokenised sequences."""
    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    ids = torch.randint(0, VOCAB - 2, (samples, LENGTH),
                        generator=torch.Generator().manual_seed(1))
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, num_train_epochs=2,
                     learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[],
                     use_cpu=True, ddp_backend="gloo", seed=7, disable_tqdm=True,
                     max_length=LENGTH)
    cls = sw.on_shardwise(SFTTrainer) if on_shardwise else SFTTrainer
    trainer = cls(model=tiny_llama(), args=args,
                  train_dataset=datasets.Dataset.from_dict({"input_ids": ids.tolist()}),
                  processing_class=word_tokenizer(),
                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    history = [{k: v for k, v in log.items() if k in kept} for log in trainer.state.log_history]
    return history, type(trainer.accelerator).__name__, trained


def test_trls_sft_trainer_with_a_lora_adapter_runs_on_shardwise_with_equal_losses(tmp_path):
    runs = {}
    for name, on in (("accelerate", False), ("shardwise", True)):
        ranks = run_distributed(sft, on, str(tmp_path / name), timeout=400)
        assert ranks[0][0] == ranks[1][0]
        runs[name] = ranks[0]
    theirs, ours = runs["accelerate"], runs["shardwise"]
    assert ours[1] == "ShardwiseAccelerator"
    assert ours[2] == theirs[2] and all("lora_" in name for name in ours[2])  # the adapter alone
    assert_same_logs(theirs[0], ours[0])


def length_reward(completions, **kwargs):
    """A reward function of TRL's form: longer completions score more."""
    return [len(completion) / 10.0 for completion in completions]


def online(on_shardwise, output_dir, names=("grpo", "rloo"), stop=None, resume=None):
    """TRL's GRPO and RLOO trainers, generating with transformers' generate and scoring with
    a reward function: each one's log history (``stop``: a checkpoint every 2 steps, training
    stopped after step ``stop``; ``resume``: the checkpoint folder it resumes from)."""
    import datasets
    from test_trainer import stop_at
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    prompts = [" ".join(f"t{(i * 7 + j) % 60}" for j in range(3)) for i in range(8)]
    kinds = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}
    saving = {"save_strategy": "steps", "save_steps": 2} if stop or resume else \
        {"save_strategy": "no"}
    out = {}
    for name in names:
        cls, config = kinds[name]
        args = config(output_dir=f"{output_dir}/{name}", per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, num_train_epochs=1,
                      learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True,
                      ddp_backend="gloo", seed=7, disable_tqdm=True, **saving,
                      beta=0.0)  # no reference model (it would be loaded from a hub name)
        model = tiny_llama()
        model.generation_config.pad_token_id = VOCAB - 2
        trainer = (sw.on_shardwise(cls) if on_shardwise else cls)(
            model=model, reward_funcs=[length_reward], args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=word_tokenizer(), callbacks=[stop_at(stop)] if stop else [])
        trainer.train(resume_from_checkpoint=resume and f"{output_dir}/{name}/{resume}")
        out[name] = logged(trainer)
    return out


def test_trls_grpo_and_rloo_trainers_run_on_shardwise_and_log_what_they_log_on_accelerate(
        tmp_path):
    """Their prompts repeated for the generations by TRL's RepeatSampler, split as Accelerate
    splits them (its BatchSamplerShard): every logged value, loss, rewards, grad_norm and
    learning_rate included, within 1e-5 at every logging step."""
    theirs = run_distributed(online, False, str(tmp_path / "accelerate"), timeout=400)[0]
    ours = run_distributed(online, True, str(tmp_path / "shardwise"), timeout=400)[0]
    for name in ("grpo", "rloo"):
        assert len(ours[name]) == len(theirs[name]) >= 4, name
        for mine, log in zip(ours[name], theirs[name], strict=True):
            assert mine.keys() == log.keys(), name
            for key, value in log.items():
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, key)
        assert {"loss", "reward", "grad_norm", "learning_rate"} <= theirs[name][0].keys()


def test_a_grpo_run_resumed_mid_epoch_continues_as_on_accelerate(tmp_path):
    """Stopped after step 2 of 4 and resumed from checkpoint-2: TRL's RepeatSampler cannot
    start part-way, so its skipped batches' indices are drawn and dropped, as Accelerate's
    skip_first_batches does; the resumed steps log what they log on Accelerate and what the
    uninterrupted run logged (it was refused with a DataError)."""
    resumed = {}
    for name, on in (("accelerate", False), ("shardwise", True)):
        run_distributed(online, on, str(tmp_path / name), ("grpo",), 2, None, timeout=400)
        resumed[name] = run_distributed(online, on, str(tmp_path / name), ("grpo",), None,
                                        "checkpoint-2", timeout=400)[0]["grpo"]
    whole = run_distributed(online, True, str(tmp_path / "whole"), ("grpo",),
                            timeout=400)[0]["grpo"]
    def after_the_stop(logs):  # the resumed history starts with the checkpoint's own
        return [log for log in logs if log["step"] > 2 and "loss" in log]

    assert [log["step"] for log in after_the_stop(resumed["shardwise"])] == [3, 4]
    assert_same_values(resumed["accelerate"], resumed["shardwise"], "grpo", at_least=5)
    assert_same_values(after_the_stop(whole), after_the_stop(resumed["shardwise"]), "grpo",
                       at_least=2)


def test_trls_per_rank_scalars_at_an_epochs_padded_last_step_are_gathered_as_on_accelerate(
        tmp_path):
    """13 samples in global batches of 4: each epoch's last step is padded. TRL gathers its
    token count and accuracy per rank through gather_for_metrics, which Accelerate cuts to
    the remainder there; the Trainer on shardwise gives the same numbers (they differed)."""
    kept = (*KEPT, "num_tokens", "mean_token_accuracy")
    runs = {name: run_distributed(sft, on, str(tmp_path / name), 13, kept, timeout=400)[0][0]
            for name, on in (("accelerate", False), ("shardwise", True))}
    assert_same_logs(runs["accelerate"], runs["shardwise"])
    assert any("num_tokens" in log for log in runs["shardwise"])


def words(i, count):
    """``count`` words of the tiny vocabulary, different for each ``i``."""
    return " ".join(f"t{(i * 7 + j * 3) % (VOCAB - 2)}" for j in range(count))


def saved_model(directory, head="causal"):
    """The tiny Llama and its tokenizer saved as a Hub folder (what TRL loads from a name)."""
    model = tiny_llama()
    model.generation_config.pad_token_id = VOCAB - 2
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return str(directory)


#: every value a trainer logs except its clock
def logged(trainer):
    return [{k: v for k, v in log.items() if k not in ("step_time", "train_runtime")
             and not k.endswith("_per_second")} for log in trainer.state.log_history]


def assert_same_values(theirs, ours, name, at_least=4):
    """Every logged value at every logging step within 1e-5."""
    assert len(ours) == len(theirs) >= at_least, name
    for mine, log in zip(ours, theirs, strict=True):
        assert mine.keys() == log.keys(), name
        for key, value in log.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, key, mine, log)


def offline(on_shardwise, output_dir, model_dir):
    """TRL's preference, reward and packed SFT trainers, each at its own defaults (bf16 on for
    DPO, KTO and Reward, as TRL sets them), a model loaded from a folder: each one's logs."""
    import datasets
    from peft import LoraConfig
    from trl import (
        DPOConfig,
        DPOTrainer,
        KTOConfig,
        KTOTrainer,
        RewardConfig,
        RewardTrainer,
        SFTConfig,
        SFTTrainer,
    )

    rows = range(16)
    data = {
        "dpo": {"prompt": [words(i, 3) for i in rows], "chosen": [" " + words(i + 1, 2) for i in rows],
                "rejected": [" " + words(i + 2, 3) for i in rows]},
        "kto": {"prompt": [words(i, 3) for i in rows], "completion": [" " + words(i + 1, 3) for i in rows],
                "label": [i % 3 != 0 for i in rows]},
        "reward": {"chosen": [words(i, 4) for i in rows], "rejected": [words(i + 5, 3) for i in rows]},
        "sft-packing": {"text": [words(i, 2 + i % 5) for i in rows]},
    }
    kinds = {"dpo": (DPOConfig, DPOTrainer, {}), "kto": (KTOConfig, KTOTrainer, {}),
             "reward": (RewardConfig, RewardTrainer, {}),
             "sft-packing": (SFTConfig, SFTTrainer, {"packing": True})}
    out = {}
    for name, (config, cls, extra) in kinds.items():
        args = config(output_dir=f"{output_dir}/{name}", per_device_train_batch_size=2,
                      num_train_epochs=1, learning_rate=3e-3, logging_steps=1,
                      save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
                      seed=7, disable_tqdm=True, max_length=LENGTH, **extra)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) \
            if name == "sft-packing" else None
        torch.manual_seed(0)  # the reward head, initialised at random when loaded
        trainer = (sw.on_shardwise(cls) if on_shardwise else cls)(
            model=model_dir, args=args, train_dataset=datasets.Dataset.from_dict(data[name]),
            peft_config=lora)
        trainer.train()
        out[name] = logged(trainer)
    return out


def test_trls_dpo_kto_reward_and_packed_sft_trainers_log_what_they_log_on_accelerate(tmp_path):
    """Loss, rewards, logps, accuracies, grad_norm and learning_rate within 1e-5 at every
    logging step."""
    model_dir = saved_model(tmp_path / "model")
    theirs = run_distributed(offline, False, str(tmp_path / "accelerate"), model_dir,
                             timeout=400)[0]
    ours = run_distributed(offline, True, str(tmp_path / "shardwise"), model_dir, timeout=400)[0]
    for name in theirs:
        assert_same_values(theirs[name], ours[name], name)
        assert {"loss", "grad_norm", "learning_rate"} <= theirs[name][0].keys(), name
        assert theirs[name][0]["grad_norm"] > 0, name  # a step that trains something
    assert {"rewards/chosen", "rewards/margins", "logps/rejected"} <= theirs["dpo"][0].keys()
    assert {"kl", "rewards/chosen"} <= theirs["kto"][0].keys()
    assert {"accuracy", "margin"} <= theirs["reward"][0].keys()


#: TRL's six training scripts, each with the arguments its data needs (besides the common ones)
SCRIPTS = {
    "sft": ("AutoModelForCausalLM", ["--max_length", str(LENGTH)]),
    "dpo": ("AutoModelForCausalLM", ["--max_length", str(LENGTH)]),
    "kto": ("AutoModelForCausalLM", ["--max_length", str(LENGTH)]),
    "reward": ("AutoModelForSequenceClassification", ["--max_length", str(LENGTH)]),
    "grpo": ("AutoModelForCausalLM", ["--reward_funcs", "rewards.length", "--num_generations",
                                      "4", "--max_completion_length", "4"]),
    "rloo": ("AutoModelForCausalLM", ["--reward_funcs", "rewards.length", "--num_generations",
                                      "4", "--max_completion_length", "4"]),
}


def on_shardwise_copy(script, target):
    """``script`` as a user ports it: ``import shardwise as sw`` and ``XTrainer(`` becomes
    ``sw.on_shardwise(XTrainer)(``; nothing else changes."""
    text, count = re.subn(r"trainer = (\w+Trainer)\(", r"trainer = sw.on_shardwise(\1)(",
                          script.read_text())
    assert count == 1, script
    target.write_text("import shardwise as sw\n" + text)
    return str(target)


def script_data(directory):
    """A local dataset folder per script (``--dataset_name <folder>``, train.jsonl in it)."""
    import json

    rows = range(16)
    data = {
        "sft": [{"text": words(i, 6)} for i in rows],
        "dpo": [{"prompt": words(i, 3), "chosen": " " + words(i + 1, 2),
                 "rejected": " " + words(i + 2, 3)} for i in rows],
        "kto": [{"prompt": words(i, 3), "completion": " " + words(i + 1, 2),
                 "label": i % 2 == 0} for i in rows],
        "reward": [{"chosen": words(i, 4), "rejected": words(i + 2, 3)} for i in rows],
        "grpo": [{"prompt": words(i, 3)} for i in range(8)],
    }
    data["rloo"] = data["grpo"]
    for name, samples in data.items():
        (directory / name).mkdir(parents=True)
        (directory / name / "train.jsonl").write_text(
            "".join(json.dumps(sample) + "\n" for sample in samples))
    (directory / "rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [len(c) / 10.0 for c in completions]\n")


def test_trls_own_scripts_end_by_saving_a_model_on_shardwise(tmp_path):
    """trl/scripts/{sft,dpo,kto,reward,grpo,rloo}.py with the trainer swapped for
    ``sw.on_shardwise(...)``, started by torchrun on 2 ranks as their docstrings start them:
    each trains on shardwise's pipeline, prints through ``accelerator.print``, saves a model
    ``from_pretrained`` loads (trained: it differs from the one it started from) and ends
    with ``trainer.end()``, which leaves the process group as on Accelerate."""
    import transformers
    import trl.scripts

    model_dir = saved_model(tmp_path / "model")
    script_data(tmp_path)
    scripts = Path(trl.scripts.__file__).parent
    start = dict(tiny_llama().named_parameters())
    for name, (auto, extra) in SCRIPTS.items():
        script = on_shardwise_copy(scripts / f"{name}.py", tmp_path / f"{name}_on_shardwise.py")
        output_dir = tmp_path / f"out_{name}"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", script,
            "--model_name_or_path", model_dir, "--dataset_name", name,
            "--output_dir", str(output_dir), "--per_device_train_batch_size", "2",
            "--num_train_epochs", "1", "--learning_rate", "3e-3", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--ddp_backend", "gloo",
            *extra]
        [(code, out, err)] = run_jobs([command], timeout=300, cwd=tmp_path)
        assert code == 0, (name, err[-6000:])
        assert "shardwise pipeline: 2 process(es) (torchrun)" in out, name
        assert out.count("Training completed.") == 1, name  # accelerator.print: rank 0 alone
        assert "has NOT been destroyed" not in err, name
        trained = getattr(transformers, auto).from_pretrained(output_dir)
        moved = [n for n, p in trained.named_parameters()
                 if n in start and not torch.equal(p, start[n])]
        assert moved, name
