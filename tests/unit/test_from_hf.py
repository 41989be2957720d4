# `shardwise from-hf` in one process: Hugging Face files into a weights-only checkpoint, and back.
import json

import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise.checkpoint.from_hf import WEIGHTS_ONLY_SKIP
from shardwise.cli import main

from conftest import llama


def saved_pretrained(folder, tied):
    """A tiny Llama saved by save_pretrained in several files: its state dict."""
    model = llama(layers=2, tied=tied)
    model.save_pretrained(folder, max_shard_size="40KB")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hugging_face_files_become_a_checkpoint_that_loads_and_converts_back(tmp_path):
    """A tied Llama's files (save_pretrained writes the embedding once, in several files)
    become a checkpoint sw.load reads into a bundle built from other weights, the tie kept;
    a load that does not skip the parts the checkpoint lacks is refused by name; to-hf
    writes the tied weight once again, as save_pretrained does."""
    from transformers import LlamaForCausalLM

    weights = saved_pretrained(tmp_path / "hf", tied=True)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    record = json.loads((tmp_path / "ckpt" / "step_00000000" / "shardwise.json").read_text())
    assert record["weights_only"] == str(tmp_path / "hf")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000000"

    torch.manual_seed(5)
    model = LlamaForCausalLM(llama(layers=2, tied=True).config)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    with pytest.raises(sw.errors.CheckpointError, match=r"weights only.*skip=\('optimizer', "
                       r"'scheduler', 'scaler', 'rng'\)"):
        sw.load(tmp_path / "ckpt", bundle)
    state = sw.load(tmp_path / "ckpt", bundle, skip=WEIGHTS_ONLY_SKIP)
    assert state.step == 0
    loaded = model.state_dict()
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight

    assert main(["to-hf", str(tmp_path / "ckpt" / "step_00000000"), str(tmp_path / "back"),
                 "--config", str(tmp_path / "hf")]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert "lm_head.weight" not in back and set(back) == set(weights) - {"lm_head.weight"}
    again = LlamaForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert all(torch.equal(again[k], v) for k, v in weights.items())


def test_forged_or_foreign_files_are_refused_and_nothing_is_published(tmp_path):
    """An index naming a file outside the folder, and a config.json Transformers builds no
    model from, are refused before a checkpoint is published; a tied pair whose values
    differ is refused by to-hf (the checkpoint is not the config's model)."""
    saved_pretrained(tmp_path / "hf", tied=False)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    good = index.read_text()
    forged = json.loads(good)
    forged["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(forged))
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    index.write_text(good)
    config = tmp_path / "hf" / "config.json"
    config.write_text(json.dumps({"model_type": "no-such-model"}))
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    assert sw.latest_checkpoint(tmp_path / "ckpt") is None

    config.unlink()  # without a config: the files' names as they are (untied: all there)
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    llama(layers=2, tied=True).config.save_pretrained(tmp_path / "tied")
    assert main(["to-hf", str(tmp_path / "ckpt" / "step_00000000"), str(tmp_path / "back"),
                 "--config", str(tmp_path / "tied")]) == 2
    assert not (tmp_path / "back").exists()


def test_experts_saved_one_by_one_are_refused_with_the_way_to_stacked_files(tmp_path):
    """save_pretrained (Transformers 5) writes a Qwen3-MoE's experts one by one; the model
    holds them stacked: load_pretrained names the files' form and the way on (sw.export)."""
    from _moe import moe

    model = moe("qwen3")
    model.save_pretrained(tmp_path / "hf")
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(sw.errors.CheckpointError, match=r"missing model\.layers\.0\.mlp\.experts"
                       r"\.down_proj.*one part at a time \(model\.layers\.0\.mlp\.experts\.0\..*"
                       r"sw\.export"):
        sw.load_pretrained(tmp_path / "hf", bundle)
    sw.export(tmp_path / "stacked", bundle)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    sw.load_pretrained(tmp_path / "stacked", bundle)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_root_with_checkpoints_a_tensor_in_two_files_and_a_failed_write_are_refused(
        tmp_path, monkeypatch):
    """from-hf never points latest back at step 0 of a run (a named one goes beside); a
    tensor two files hold and a bad --name are refused; a write that fails half-way leaves
    no staging folder and nothing published."""
    import safetensors
    from safetensors.torch import save_file

    saved_pretrained(tmp_path / "hf", tied=False)
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run"), "--name",
                 "pretrained"]) == 0
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000000"
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--name", "../up"]) == 2

    (tmp_path / "two").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "two" / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "two" / "b.safetensors")
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    with pytest.raises(sw.errors.CheckpointError, match=r"w in two files or in pieces"):
        from shardwise.checkpoint.from_hf import hf_to_checkpoint
        hf_to_checkpoint(tmp_path / "two", tmp_path / "never")

    real, calls = safetensors.safe_open, []

    class Failing:  # the third tensor read fails (a disk gone mid-write)
        def __init__(self, *args, **kwargs):
            self._opened = real(*args, **kwargs)

        def __enter__(self):
            self._opened.__enter__()
            return self

        def __exit__(self, *exc):
            return self._opened.__exit__(*exc)

        def __getattr__(self, name):  # keys(), metadata(), ... as they are
            return getattr(self._opened, name)

        def get_tensor(self, name):
            calls.append(name)
            if len(calls) == 3:
                raise OSError("the disk went away")
            return self._opened.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Failing)
    with pytest.raises(sw.errors.CheckpointError, match=r"the disk went away.*nothing was "
                       r"published"):
        hf_to_checkpoint(tmp_path / "hf", tmp_path / "failed")
    assert sw.latest_checkpoint(tmp_path / "failed") is None
    assert not [p for p in (tmp_path / "failed").iterdir() if p.name.startswith(".tmp")]
