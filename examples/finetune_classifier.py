# Fine-tune a tiny BERT-like classifier: evaluation each epoch with exact metrics, resume.
"""Run with ``python examples/finetune_classifier.py`` or under ``torchrun --nproc_per_node=2``.

The shape of Accelerate's ``nlp_example.py``, ported: a Transformers sequence classifier
(random weights, built offline), a dataset the script makes, AdamW with a linear warm-up,
evaluation after every epoch whose accuracy is the same on any number of processes
(``bundle.predict`` + ``sw.gather_for_metrics``), and checkpoints that resume where the
run stopped (run it twice with the same ``--checkpoint-dir``: the second run continues).
Needs ``transformers`` (``pip install transformers``).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

import shardwise as sw


class Sentiment(Dataset):
    """Token sequences labelled by whether "positive" tokens (8-11) outnumber "negative"
    ones (4-7)."""

    def __init__(self, size: int, seq_len: int = 12, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, 12, (size, seq_len), generator=gen)
        self.labels = ((self.ids >= 8).sum(1) * 2 > seq_len).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def accuracy(bundle: sw.Bundle) -> dict[str, float]:
    """Accuracy over the whole evaluation set, exact on any world size."""
    correct = seen = 0
    assert bundle.eval_loader is not None
    for batch in bundle.eval_loader:
        predictions = bundle.predict(batch).logits.argmax(-1)
        predictions, labels = sw.gather_for_metrics((predictions, batch["labels"]),
                                                    bundle.eval_loader)
        correct += int((predictions == labels).sum())
        seen += len(labels)
    return {"accuracy": correct / seen, "samples": seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # fit's loss and eval lines

    torch.manual_seed(0)
    config = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train = DataLoader(Sentiment(512), batch_size=args.batch_size, shuffle=True, drop_last=True)
    evaluation = DataLoader(Sentiment(203, seed=1), batch_size=args.batch_size)  # 203: padding
    steps_per_epoch = len(train) // sw.detect().world_size
    # the scheduler steps once per optimizer step (Accelerate's steps once per process)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / steps_per_epoch))
    bundle = sw.pipeline(sw.detect(), sw.clip_gradients(1.0))(
        model, optimizer, train, scheduler=scheduler, eval_loader=evaluation)
    state = sw.fit(bundle, epochs=args.epochs, checkpoint_dir=args.checkpoint_dir,
                   eval_fn=accuracy, eval_every=steps_per_epoch, log_every=steps_per_epoch,
                   progress=False)
    result = accuracy(bundle)
    if bundle.env.is_main:
        print(f"epoch {state.epoch} step {state.step}: accuracy {result['accuracy']:.4f} "
              f"over {result['samples']} samples on {bundle.env.world_size} process(es)",
              flush=True)


if __name__ == "__main__":
    main()
