# Evaluation: predict at the training precision, exact metrics over padded shards, reduce, main first.
# Its tests that start no process are in tests/unit/test_evaluate.py.
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shardwise as sw
from shardwise.testing import run_distributed

from conftest import ONE


class Labelled(Dataset):
    """``size`` samples (x, label) from a fixed generator; labels 0..2."""

    def __init__(self, size):
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 6, generator=gen)
        self.y = torch.randint(0, 3, (size,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x, y=None):
        logits = self.net(x)
        return logits if y is None else torch.nn.functional.cross_entropy(logits, y)


def one_process_loss(size):
    x, y = Labelled(size).x, Labelled(size).y
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(Classifier().net(x), y).item()


def one_process_accuracy(size, batch_size):
    model, correct = Classifier(), 0
    for x, y in DataLoader(Labelled(size), batch_size=batch_size):
        with torch.no_grad():
            correct += int((model(x).argmax(-1) == y).sum())
    return correct, size


def evaluate(parts, size, batch_size):
    model = Classifier()
    bundle = sw.pipeline(sw.detect(), *parts)(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        eval_loader=DataLoader(Labelled(size), batch_size=batch_size))
    correct, seen, labels, dtypes = 0, 0, [], set()
    for x, y in bundle.eval_loader:
        logits = bundle.predict((x,))
        dtypes.add(str(logits.dtype))
        preds, y = sw.gather_for_metrics((logits.argmax(-1), y), bundle.eval_loader)
        correct += int((preds == y).sum())
        seen += len(y)
        labels += y.tolist()
    total = sw.reduce(torch.tensor(float(seen)), op="sum")
    return {"correct": correct, "seen": seen, "evaluated": sw.evaluate(bundle),
            "labels": sorted(labels), "dtypes": dtypes,
            "batches": len(bundle.eval_loader), "mean_of_sums": float(total),
            "training": bundle.model.training}


def evaluate_all(size, batch_size):
    return {"replicate": evaluate([sw.replicate()], size, batch_size),
            "shard": evaluate([sw.shard(sw.by_class("Linear"))], size, batch_size),
            "replicate_bf16": evaluate([sw.replicate(), sw.mixed_precision("bf16")], size,
                                       batch_size),
            "shard_bf16": evaluate([sw.shard(sw.by_class("Linear")), sw.mixed_precision("bf16")],
                                   size, batch_size)}


@pytest.mark.parametrize("world, size, batch_size", [(2, 45, 4), (4, 45, 4), (4, 10, 2)])
def test_metrics_over_padded_shards_equal_one_process_exactly(world, size, batch_size):
    results = run_distributed(evaluate_all, size, batch_size, world_size=world)
    expected_correct, _ = one_process_accuracy(size, batch_size)
    expected_labels = sorted(Labelled(size).y.tolist())
    for rank_results in results:
        for name, got in rank_results.items():
            assert got["seen"] == size, (name, got["seen"])  # no padded sample counted
            assert got["labels"] == expected_labels, name
            # sw.evaluate: the mean loss over each sample once, padding cut
            assert got["evaluated"]["items"] == size, name
            if "bf16" not in name:
                assert got["correct"] == expected_correct, name
                assert got["evaluated"]["loss"] == pytest.approx(one_process_loss(size), rel=1e-6)
            else:  # evaluated at the training precision under both engines
                assert got["dtypes"] == {"torch.bfloat16"}, (name, got["dtypes"])
            assert got["mean_of_sums"] == size * world
            assert got["training"] is True  # predict restores train mode
    batches = {r[name]["batches"] for r in results for name in r}
    assert len(batches) == 1  # every rank runs the same number of batches


def evaluate_extra_loaders(sizes):
    """A training loader, then one more loader per size distributed by the bundle: each
    loader's gathered labels and correct predictions over one pass."""
    model = Classifier()
    bundle = sw.pipeline(sw.detect(), sw.replicate())(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(Labelled(8), batch_size=2))
    extra = {f"set{size}": bundle.distribute(DataLoader(Labelled(size), batch_size=3))
             for size in sizes}
    found = {}
    for name, loader in extra.items():
        labels, correct, batches = [], 0, 0
        for x, y in loader:
            preds, y = sw.gather_for_metrics((bundle.predict((x,)).argmax(-1), y), loader)
            labels += y.tolist()
            correct += int((preds == y).sum())
            batches += 1
        found[name] = (labels, correct, batches)
    return found


def test_any_number_of_extra_loaders_are_distributed_and_gathered_exactly():
    """bundle.distribute(loader) splits a third, fourth, ... loader as eval_loader is split:
    the gathered labels are each dataset in order (padding dropped; 7 and 11 samples do not
    divide into 2 ranks' batches of 3) and the correct count is one process's."""
    ranks = run_distributed(evaluate_extra_loaders, (7, 11), world_size=2)
    assert ranks[0] == ranks[1]
    for size in (7, 11):
        labels, correct, batches = ranks[0][f"set{size}"]
        assert sorted(labels) == sorted(Labelled(size).y.tolist()) and len(labels) == size
        assert correct == one_process_accuracy(size, 3)[0]
    with pytest.raises(sw.errors.ArgumentError, match="built without one"):
        sw.Bundle(model=torch.nn.Linear(2, 2), env=ONE).distribute([1, 2])  # built by hand


def first_then_others(path):
    env = sw.detect()
    with sw.main_process_first(env):
        if env.is_main:
            time.sleep(1.0)
            with open(path, "w") as stream:
                stream.write("prepared")
        seen = os.path.exists(path)
    return seen


def test_main_process_first_lets_the_others_in_after_it(tmp_path):
    path = str(tmp_path / "prepared.txt")
    assert run_distributed(first_then_others, path, world_size=2) == [True, True]
