# Evaluation in one process: sw.evaluate counts each labelled token (or sample) once, fit's eval/loss,
# predict at the training precision, gather and reduce.
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw

from conftest import ONE


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2))


def batches():
    """Three batches with prompts of different lengths masked with -100."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for size in (2, 3, 1):
        ids = torch.randint(0, 32, (size, 8), generator=gen)
        labels = ids.clone()
        for row in range(size):
            labels[row, : 1 + 2 * row] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_a_causal_lm_is_weighed_by_its_labelled_tokens_not_by_its_batches():
    model = llama()
    bundle = sw.pipeline(ONE)(model, None)
    got = sw.evaluate(bundle, batches())
    loss_sum, tokens, means = 0.0, 0, []
    with torch.no_grad():
        for batch in batches():
            out = model(**batch)
            count = int((batch["labels"][:, 1:] != -100).sum())
            loss_sum += out.loss.item() * count  # Transformers' loss: the mean over its tokens
            tokens += count
            means.append(out.loss.item())
    assert got["items"] == tokens
    assert got["loss"] == pytest.approx(loss_sum / tokens, rel=1e-6)
    assert abs(got["loss"] - sum(means) / len(means)) > 1e-4  # not the mean of batch means
    assert model.training  # train mode restored


def test_a_loss_fn_sum_and_count_and_a_plain_loss_are_counted_once():
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(n, 3), torch.randint(0, 2, (n,))) for n in (4, 1, 3)]

    def mean(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    def summed(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="sum"), len(batch[1])

    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    for loss_fn in (mean, summed):
        got = sw.evaluate(sw.pipeline(ONE)(model, None, loss_fn=loss_fn), data)
        assert got == {"loss": pytest.approx(expected, rel=1e-6), "items": 8}


def test_per_token_labels_with_a_plain_loss_and_no_loader_are_refused():
    model = torch.nn.Linear(3, 2)
    bundle = sw.pipeline(ONE)(model, None, loss_fn=lambda m, b: m(b["x"]).sum())
    with pytest.raises(sw.errors.LossError, match="loss_fn returning .loss_sum, num_tokens."):
        sw.evaluate(bundle, [{"x": torch.ones(2, 3), "labels": torch.ones(2, 4, dtype=torch.long)}])
    with pytest.raises(sw.errors.ArgumentError, match="needs a loader"):
        sw.evaluate(bundle)


def test_fit_logs_evaluate_as_its_eval_loss():
    model = llama()
    logged = []

    class Record:
        def log(self, metrics, step):
            logged.append(metrics)

        def close(self):
            pass

    loader = DataLoader([{"input_ids": b["input_ids"][0], "labels": b["labels"][0]}
                         for b in batches()], batch_size=1)
    bundle = sw.pipeline(ONE)(model, torch.optim.SGD(model.parameters(), lr=0.0), loader,
                              eval_loader=batches())
    sw.fit(bundle, steps=2, eval_fn=sw.evaluate, eval_every=2, log_every=None, loggers=[Record()],
           progress=False)
    assert logged[-1]["eval/loss"] == pytest.approx(sw.evaluate(bundle)["loss"], rel=1e-7)


# -- predict, gather_for_metrics and reduce, explain() ------------------------------------

def test_predict_runs_without_gradients_in_eval_mode_at_the_training_precision():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    bundle = sw.pipeline(ONE, sw.mixed_precision("bf16"))(model, torch.optim.SGD(model.parameters()))
    x = torch.ones(2, 4)
    out = bundle.predict(x)
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    assert torch.equal(out, bundle.predict(x))  # dropout off
    assert model.training
    fp32 = sw.pipeline(ONE)(torch.nn.Linear(4, 4), None)
    assert fp32.predict(x).dtype == torch.float32


def test_gather_and_reduce_in_one_process_return_the_values():
    values = {"a": torch.arange(3), "b": (torch.ones(2),)}
    assert sw.gather_for_metrics(values) is values
    assert float(sw.reduce(2.5, op="max")) == 2.5
    with pytest.raises(ValueError, match="'op' must be 'mean', 'sum', 'max' or 'min' .got 'avg'"):
        sw.reduce(1.0, op="avg")


def test_explain_says_where_shardwise_differs_from_accelerate():
    text = sw.pipeline(ONE, sw.mixed_precision("bf16")).explain()
    assert "scheduler: steps once per optimizer step" in text
    assert "bundle.predict runs at the training precision" in text
