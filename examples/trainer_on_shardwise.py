# A Transformers Trainer script on shardwise: one import changed; the Trainer's loop and checkpoints kept.
"""Run with ``torchrun --nproc_per_node=2 examples/trainer_on_shardwise.py`` (or ``python``).

The shape of a run_clm-style Trainer script: a causal language model (a tiny Llama with
random weights, built offline), a dataset the script makes, ``TrainingArguments`` with
evaluation, logging and checkpoints, and ``compute_metrics``. The only shardwise line is
the Trainer class: ``sw.Trainer`` where the script had ``transformers.Trainer``. Pass
``--accelerate`` to run the same script on Accelerate and compare the printed numbers.
Needs ``transformers``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import shardwise as sw


class Counting(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod 32): the next token is learnable."""

    def __init__(self, size: int, length: int = 16, seed: int = 0) -> None:
        start = torch.randint(0, 32, (size, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(length)) % 32

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def next_token_accuracy(prediction: object) -> dict[str, float]:
    logits, labels = prediction.predictions, prediction.label_ids  # type: ignore[attr-defined]
    return {"accuracy": float(np.mean(logits[:, :-1].argmax(-1) == labels[:, 1:]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="trainer_out")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--accelerate", action="store_true", help="the Trainer on Accelerate")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint")
    options = parser.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
    args = TrainingArguments(
        output_dir=options.output_dir, num_train_epochs=options.epochs,
        per_device_train_batch_size=8, per_device_eval_batch_size=8, learning_rate=3e-3,
        warmup_steps=4, weight_decay=0.01, logging_steps=8, eval_strategy="steps",
        eval_steps=16, save_strategy="steps", save_steps=16, save_total_limit=2,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    cls = Trainer if options.accelerate else sw.Trainer
    trainer = cls(model=model, args=args, train_dataset=Counting(256),
                  eval_dataset=Counting(60, seed=1), compute_metrics=next_token_accuracy)
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"final: eval_loss {metrics['eval_loss']:.6f} accuracy "
              f"{metrics['eval_accuracy']:.4f} step {trainer.state.global_step} on "
              f"{trainer.args.world_size} process(es) with {type(trainer.accelerator).__name__}",
              flush=True)


if __name__ == "__main__":
    main()
