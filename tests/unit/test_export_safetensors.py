# export() in one process: safetensors at a chosen dtype; a Transformers model back through from_pretrained.
import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw

from _checkpointing import trained


def test_export_casts_to_a_dtype(tmp_path):
    bundle = trained([])
    sw.export(tmp_path, bundle, dtype=torch.bfloat16)
    weights = load_file(tmp_path / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert not (tmp_path / "config.json").exists()


def test_a_transformers_model_round_trips_through_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.max_new_tokens, model.generation_config.do_sample = 7, False
    pipe = sw.pipeline(sw.Env(), sw.checkpoint_activations(sw.by_class("LlamaDecoderLayer")))
    bundle = pipe(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 64, (2, 12))
    state = bundle.init()
    for _ in range(2):
        state, out = bundle.step(state, {"input_ids": ids, "labels": ids})
    sw.export(tmp_path, bundle)
    assert (tmp_path / "config.json").is_file()
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    assert (tmp_path / "generation_config.json").is_file()
    assert again.generation_config.max_new_tokens == 7
    prompt = ids[:1, :4]
    assert torch.equal(again.generate(prompt), model.eval().generate(prompt))


def _llama(tie=True, layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers, transformers.LlamaForCausalLM(config)


def test_tied_weights_are_written_once_and_big_models_in_indexed_files(tmp_path):
    """As save_pretrained: the tied head once (under the embedding's name), and a model
    over max_shard_size in model-0000i-of-0000N files with an index naming each tensor's."""
    import json

    transformers, model = _llama()
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sw.export(tmp_path / "one", bundle)
    weights = load_file(tmp_path / "one" / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    sw.export(tmp_path / "many", bundle, max_shard_size=20_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in weights.values())
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "many")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "one"]  # nothing left beside


def test_an_export_replaces_the_last_one_whole_and_keeps_the_users_files(tmp_path):
    _, model = _llama(tie=False)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = tmp_path / "final"
    sw.export(out, bundle, max_shard_size=20_000)
    (out / "tokenizer.json").write_text("{}")
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("mine")
    sw.export(out, bundle)  # now one file: the old shards and their index go
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "extra", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "extra" / "notes.txt").read_text() == "mine"
    with pytest.raises(sw.errors.ArgumentError, match="max_shard_size"):
        sw.export(out, bundle, max_shard_size=0)


def test_a_crash_between_the_renames_is_finished_by_the_next_export(tmp_path):
    """Killed after the old folder was set aside and before the new one was renamed in:
    the name is empty, the old export is beside it; the next export puts it back first
    (and a staging folder left by a kill is cleared)."""
    _, model = _llama(tie=False)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = tmp_path / "final"
    sw.export(out, bundle)
    (out / "tokenizer.json").write_text("{}")
    out.rename(tmp_path / ".final.export.old")
    (tmp_path / ".final.export.tmp").mkdir()
    (tmp_path / ".final.export.tmp" / "model.safetensors").write_text("half")
    sw.export(out, bundle)
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").stat().st_size > 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_an_export_never_follows_a_symlink(tmp_path):
    _, model = _llama(tie=False)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "final").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(sw.errors.CheckpointError, match="is a symlink"):
        sw.export(tmp_path / "final", bundle)
    (tmp_path / "file").write_text("x")
    with pytest.raises(sw.errors.CheckpointError, match="is a file"):
        sw.export(tmp_path / "file", bundle)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_pretrained_files_load_into_a_bundle_and_refuse_what_does_not_fit(tmp_path):
    transformers, model = _llama(tie=True)
    model.save_pretrained(tmp_path / "files")
    torch.manual_seed(5)
    other = transformers.LlamaForCausalLM(model.config)
    bundle = sw.pipeline(sw.Env())(other, torch.optim.SGD(other.parameters(), lr=0.1))
    assert sw.load_pretrained(tmp_path / "files", bundle) is bundle
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still one weight
    _, wider = _llama(tie=True, layers=3)
    bundle = sw.pipeline(sw.Env())(wider, torch.optim.SGD(wider.parameters(), lr=0.1))
    with pytest.raises(sw.errors.CheckpointError, match=r"missing model\.layers\.2\."):
        sw.load_pretrained(tmp_path / "files", bundle)
    with pytest.raises(sw.errors.CheckpointError, match="is not a folder"):
        sw.load_pretrained(tmp_path / "nowhere", bundle)


def test_a_cast_leaves_integer_and_bool_tensors_as_they_are(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.tensor([True, False]))
    model[1].num_batches_tracked.fill_(3)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sw.export(tmp_path / "out", bundle, dtype=torch.bfloat16)
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights["0.weight"].dtype == torch.bfloat16
    assert weights["1.num_batches_tracked"].dtype == torch.int64
    assert weights["1.num_batches_tracked"].shape == () and weights["1.num_batches_tracked"] == 3
    assert torch.equal(weights["mask"], torch.tensor([True, False]))


def test_loading_reads_the_files_the_index_names_and_refuses_forged_ones(tmp_path):
    """As from_pretrained: a stray ``consolidated.safetensors`` beside the indexed files is
    not the model's; an index naming a file that is not there, or outside the folder, one
    that is not an index, and a tensor in two of its files are refused, named."""
    import json

    from safetensors.torch import save_file

    _, model = _llama(tie=False)
    files = tmp_path / "files"
    model.save_pretrained(files, max_shard_size="20KB")
    save_file({k: torch.zeros_like(v) for k, v in model.state_dict().items()},
              files / "consolidated.safetensors")
    torch.manual_seed(5)
    _, other = _llama(tie=False)
    bundle = sw.pipeline(sw.Env())(other, torch.optim.SGD(other.parameters(), lr=0.1))
    sw.load_pretrained(files, bundle)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())
    index_path = files / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    for name, message in [("../outside.safetensors", "names the file"),
                          ("model-99999-of-99999.safetensors", "names the file")]:
        forged = {**index, "weight_map": {**index["weight_map"], "lm_head.weight": name}}
        index_path.write_text(json.dumps(forged))
        with pytest.raises(sw.errors.CheckpointError, match=message):
            sw.load_pretrained(files, bundle)
    index_path.write_text("[1, 2")
    with pytest.raises(sw.errors.CheckpointError, match="is not a safetensors index"):
        sw.load_pretrained(files, bundle)
    index_path.write_text(json.dumps(index))
    save_file({"lm_head.weight": model.lm_head.weight.detach()}, files / "model-extra.safetensors")
    doubled = {**index, "weight_map": {**index["weight_map"], "x": "model-extra.safetensors"}}
    index_path.write_text(json.dumps(doubled))
    with pytest.raises(sw.errors.CheckpointError, match=r"lm_head\.weight in two files"):
        sw.load_pretrained(files, bundle)
    assert first in {p.name for p in files.iterdir()}


def test_a_users_config_stays_when_the_new_export_writes_none(tmp_path):
    model = torch.nn.Linear(4, 4)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sw.export(tmp_path / "out", bundle)
    (tmp_path / "out" / "config.json").write_text('{"mine": 1}')
    sw.export(tmp_path / "out", bundle)
    assert (tmp_path / "out" / "config.json").read_text() == '{"mine": 1}'


def test_a_stale_staging_folder_inside_the_output_is_cleared(tmp_path):
    """What a killed write left (the pieces folder of a Trainer checkpoint) is not read."""
    from safetensors.torch import save_file

    from shardwise.checkpoint.hf_files import SHARDED, export_state, write_hf_files

    model = torch.nn.Linear(4, 4)
    (tmp_path / SHARDED).mkdir()
    forged = tmp_path / SHARDED / "shard-00001-model-00001-of-00001.safetensors"
    save_file({"weight": torch.zeros(4, 4)}, forged)
    write_hf_files(sw.Env(), export_state(model, None), tmp_path, 10**9)
    assert torch.equal(load_file(tmp_path / "model.safetensors")["weight"], model.weight.detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_no_file_of_the_plan_passes_the_limit_but_a_tensor_larger_than_it():
    import math
    import random

    from shardwise.checkpoint.hf_files import file_plan

    rng = random.Random(0)
    for _ in range(200):
        sizes = [(f"t{i}", rng.choice([1, 10, 100, 1000])) for i in range(rng.randint(1, 40))]
        limit = rng.choice([50, 300, 2000])
        total = sum(size for _, size in sizes)
        plan = file_plan(sizes, math.ceil(total / limit), limit)
        indices = list(plan.values())
        assert indices == sorted(indices) and set(indices) == set(range(1, max(indices) + 1))
        for index in set(indices):
            held = [size for name, size in sizes if plan[name] == index]
            assert sum(held) <= limit or len(held) == 1, (sizes, limit, plan)


def test_a_tensor_stored_in_pieces_is_refused_not_read_in_part(tmp_path):
    """A forged DCP offset makes a [2, 4] piece claim rows 2-3 of a [4, 4] weight: rows
    0-1 would never be read (uninitialised under init_on_meta). Whole tensors only."""
    import json

    from safetensors.torch import save_file

    model = torch.nn.Linear(4, 4)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    offsets = {"weight": {"saved_offsets": [2, 0]}, "bias": {"saved_offsets": [0]}}
    (tmp_path / "files").mkdir()
    save_file({"weight": torch.ones(2, 4), "bias": torch.ones(4)},
              tmp_path / "files" / "model.safetensors",
              metadata={"DCP_SHARDING_INFO": json.dumps(offsets)})
    before = model.weight.detach().clone()
    with pytest.raises(sw.errors.CheckpointError, match=r"weight in two files or in pieces"):
        sw.load_pretrained(tmp_path / "files", bundle)
    assert torch.equal(model.weight.detach(), before)
