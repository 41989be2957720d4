# Pipeline stages without ranks: where a model is cut, what a stage holds, the memory in flight.
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.errors import ArgumentError, ConflictError
from shardwise.parallel.pp_memory import held_modules, in_flight
from shardwise.parallel.pp_schedule import schedule_of
from shardwise.parallel.pp_stages import check_views, split_of, stage_modules

pytest.importorskip("transformers")

TWO = sw.Env(world_size=2, local_world_size=2)


def llama(layers=4, tied=False, vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        attn_implementation="sdpa"))


def test_auto_balances_parameters_with_the_embeddings_and_head_counted():
    # a large vocabulary: the embeddings (stage 0) and head (last stage) outweigh layers
    model = llama(layers=6, vocab=2048)
    split = split_of(model, 2, "auto")
    assert split.kind == "decoder" and split.bounds == ((0, 3), (3, 6))
    three = split_of(model, 3, "auto")
    assert three.bounds[0][1] - three.bounds[0][0] < 3  # the first stage takes fewer layers
    given = split_of(model, 2, ["model.layers.1"])
    assert given.bounds == ((0, 1), (1, 6))
    assert sum(given.params) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ConflictError, match="7 stages, but the model has 6 layers"):
        split_of(model, 7, "auto")
    with pytest.raises(ArgumentError, match="must name layers in order"):
        split_of(model, 3, ["model.layers.4", "model.layers.2"])
    with pytest.raises(ArgumentError, match="1 layer name.s. where stages 1..1 begin"):
        split_of(model, 2, ["model.layers.1", "model.layers.2"])


def test_stages_compose_to_the_whole_model_and_a_forward_that_does_more_is_refused():
    model = llama()
    split = split_of(model, 4, "auto")
    ids = torch.randint(0, 64, (2, 8))
    x = ids
    for stage in stage_modules(model, split, range(4)):
        x = stage(x)
    torch.testing.assert_close(x, model(input_ids=ids, use_cache=False).logits)
    check_views(model, split)  # passes
    original = model.model.forward

    def scaled(*args, inputs_embeds=None, **kwargs):  # a forward that scales embeddings
        if inputs_embeds is not None:
            inputs_embeds = inputs_embeds * 2
        return original(*args, inputs_embeds=inputs_embeds, **kwargs)

    model.model.forward = scaled
    with pytest.raises(ConflictError, match="do not give its own forward's logits"):
        check_views(model, split)


def test_a_sequential_is_cut_between_children_and_anything_else_is_refused():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    split = split_of(model, 2, ["2"])
    assert split.kind == "sequential" and split.bounds == ((0, 2), (2, 4))
    held = held_modules(model, split, [1])
    assert {id(p) for p in held.parameters()} == {id(p) for m in list(model)[2:]
                                                  for p in m.parameters()}
    with pytest.raises(ConflictError, match="write it as an nn.Sequential of its blocks"):
        split_of(nn.Linear(2, 2), 2, "auto")


def test_in_flight_follows_torchs_own_schedule():
    # GPipe runs every microbatch's forward first; 1F1B keeps at most p on the first rank
    gpipe = schedule_of("GPipe").order(2, 4)
    assert in_flight(gpipe[0], lambda s: 10) == 40
    one_f_one_b = schedule_of("1F1B").order(2, 4)
    assert in_flight(one_f_one_b[0], lambda s: 10) == 20
    assert in_flight(one_f_one_b[1], lambda s: 10) == 10
    assert schedule_of("DualPipeV").stages_on(0, 2) == [0, 3]
    assert schedule_of("LoopedBFS").stages_on(1, 2) == [1, 3]
    assert schedule_of("1F1B").bubble(2, 2) == pytest.approx(1 / 3)
    assert schedule_of("Interleaved1F1B").bubble(4, 8) == pytest.approx(3 / 19)
    # the record says what each schedule is, once (every part asks it, none tests a name)
    zbv = schedule_of("ZBVZeroBubble")
    assert (zbv.multi, zbv.v_shaped, zbv.zero_bubble, zbv.per_rank) == (True, True, True, 2)
    assert zbv.torch_class().__name__ == "ScheduleZBVZeroBubble"
    assert (schedule_of("1F1B").multi, schedule_of("Interleaved1F1B", 3).per_rank) == (False, 3)


def test_the_estimate_holds_the_busiest_ranks_stages():
    with torch.device("meta"):
        model = llama(layers=4, vocab=2048)
    ids = torch.zeros(4, 16, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    whole = sw.estimate_memory(model, [], sw.Env(), batch=batch)
    gpipe = sw.estimate_memory(model, [sw.pipeline_parallel(schedule="GPipe")], TWO, batch=batch)
    split = split_of(model, 2, "auto")
    last = held_modules(model, split, [1])  # the head's stage: the most parameters
    assert gpipe.params_bytes == sum(p.numel() * 4 for p in last.parameters()) + \
        sum(b.numel() * b.element_size() for b in last.buffers())
    assert "rank 1 needs the most, holding stages [1]" in gpipe.layout
    assert 0 < gpipe.params_bytes < whole.params_bytes
    # GPipe holds every microbatch of its stage: about its share of the whole batch's
    assert 0 < gpipe.activations_bytes < whole.activations_bytes
    one_f = sw.estimate_memory(model, [sw.pipeline_parallel(microbatches=4)], TWO, batch=batch)
    gpipe4 = sw.estimate_memory(model, [sw.pipeline_parallel(schedule="GPipe", microbatches=4)],
                                TWO, batch=batch)
    assert one_f.activations_bytes < gpipe4.activations_bytes  # 1F1B keeps fewer in flight


def test_the_estimate_shards_each_stage_over_its_data_ranks():
    with torch.device("meta"):
        model = llama(layers=4, vocab=2048)
    four = sw.Env(world_size=4, local_world_size=4)
    alone = sw.estimate_memory(model, [sw.pipeline_parallel(size=2)], TWO)
    sharded = sw.estimate_memory(model, [sw.pipeline_parallel(size=2), sw.shard()], four)
    default = sw.estimate_memory(model, [sw.pipeline_parallel(size=2)], four)  # shard() chosen
    assert "shard over 2 ranks" in sharded.layout
    assert sharded.params_bytes == default.params_bytes
    assert sharded.params_bytes == pytest.approx(alone.params_bytes / 2, rel=0.01)


def test_the_estimate_splits_each_stage_by_tensor_and_context_parallel():
    """pp=2 x tp=2: the busiest stage's split layers hold half their weights; pp=2 x cp=2:
    each rank's stage activations are those of half of every sequence."""
    with torch.device("meta"):
        model = llama(layers=4, vocab=2048)
    four = sw.Env(world_size=4, local_world_size=4)
    ids = torch.zeros(4, 16, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    alone = sw.estimate_memory(model, [sw.pipeline_parallel(size=2)], TWO, batch=batch)
    split = sw.estimate_memory(model, [sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2)],
                               four, batch=batch)
    assert "tensor parallel over 2 ranks" in split.layout
    assert alone.params_bytes / 2 < split.params_bytes < alone.params_bytes * 0.6  # norms whole
    sliced = sw.estimate_memory(model, [sw.pipeline_parallel(size=2),
                                        sw.context_parallel(size=2)], four, batch=batch)
    assert "context parallel over 2" in sliced.layout
    assert sliced.activations_bytes == pytest.approx(alone.activations_bytes / 2, rel=0.01)
