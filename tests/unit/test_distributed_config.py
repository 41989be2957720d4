# Transformers' DistributedConfig read as a config: each size the transform that runs it.
"""pp_size, tp_size, fsdp_size and dp_replicate_size from a ``DistributedConfig`` (the object,
its dict, or a JSON file of it) build the pipeline code would write; what shardwise cannot
honour is refused naming the key."""

import json

import pytest

import shardwise as sw
from shardwise.errors import ConfigError

transformers = pytest.importorskip("transformers")
from transformers.distributed import DistributedConfig  # noqa: E402

EIGHT = sw.Env(world_size=8, local_world_size=8)


def configured(pipe):
    return [s.transform for s in pipe.steps if s.origin == "config"]


def test_sizes_build_the_pipeline_code_would_write(tmp_path):
    # the dict of a DistributedConfig (whose object refuses fsdp_size beside pp_size)
    config = {**DistributedConfig().to_dict(), "pp_size": 2, "tp_size": 2, "fsdp_size": 2,
              "fsdp_mixed_precision": True}
    path = tmp_path / "distributed.json"
    path.write_text(json.dumps(config))
    code = sorted([sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2), sw.shard(),
                   sw.mixed_precision("bf16")], key=lambda t: t.stage)
    for source in (config, path):
        pipe = sw.from_config(source, env=EIGHT)
        assert configured(pipe) == code
        text = pipe.explain()
        assert "mesh: dp_shard=2 x pp=2 x tp=2 over 8 ranks" in text
        assert "[from distributed config" in text
        # Transformers refuses FSDP beside pp; shardwise shards each stage, and says so
        assert "Transformers 5.25 refuses FSDP with pipeline parallelism" in text


def test_pipeline_and_tensor_sizes_alone_and_hsdp():
    four = sw.Env(world_size=4, local_world_size=4)
    assert configured(sw.from_config(DistributedConfig(pp_size=4), env=four)) == [
        sw.pipeline_parallel(size=4)]
    assert configured(sw.from_config(DistributedConfig(pp_size=2, tp_size=2), env=four)) == [
        sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2)]
    assert configured(sw.from_config({"pp_size": 2, "tp_size": 2}, env=four)) == [
        sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2)]
    two_nodes = sw.Env(world_size=8, local_world_size=4, num_nodes=2, node_rank=0)
    hsdp = sw.from_config({"dp_replicate_size": 2, "fsdp_size": 2, "tp_size": 2}, env=two_nodes)
    assert configured(hsdp) == [sw.tensor_parallel(size=2), sw.shard(replicate_across_nodes=True)]
    offloaded = sw.from_config(DistributedConfig(fsdp_size=8, fsdp_cpu_offload=True), env=EIGHT)
    assert configured(offloaded) == sorted([sw.shard(), sw.offload()], key=lambda t: t.stage)
    with pytest.raises(ConfigError, match="offload.. is not combined with pipeline_parallel"):
        sw.from_config({"pp_size": 2, "fsdp_size": 4, "fsdp_cpu_offload": True}, env=EIGHT)
    # Transformers' expert parallelism inside its FSDP ranks
    experts = sw.from_config(DistributedConfig(fsdp_size=8, ep_size=8,
                                               ep_implementation="all_to_all"), env=EIGHT)
    assert configured(experts) == [sw.expert_parallel(), sw.shard()]
    groups = sw.from_config(DistributedConfig(fsdp_size=8, ep_size=2), env=EIGHT)
    assert configured(groups) == [sw.expert_parallel(size=2), sw.shard()]
    # tp_size left to Transformers' rule: the ranks the other sizes leave, when a plan is set
    assert configured(sw.from_config({"pp_size": 2, "tp_plan": "auto"}, env=four)) == [
        sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2)]


@pytest.mark.parametrize("config, message", [
    ({"pp_size": 3}, r"pp_size=3 x fsdp_size=1 x dp_replicate_size=1 x tp_size=1 = 3 ranks, "
                     r"but this run has 8"),
    ({"pp_size": 0}, r"pp_size=0 is not accepted; accepted: an integer >= 1"),
    ({"pp_size": 2, "fsdp_size": 4, "ep_size": 2}, r"ep_size=2 beside pp_size=2.*other "
                                                     r"layouts are not built yet"),
    ({"fsdp_size": 8, "ep_size": 3}, r"ep_size=3 beside .*fsdp_size=8.*a divisor of fsdp_size"),
    ({"fsdp_size": 8, "ep_size": 8, "ep_implementation": "all_reduce"},
     r"ep_implementation='all_reduce' is not accepted; accepted: 'auto' or 'all_to_all'"),
    ({"fsdp_size": 8, "ep_size": 8, "ep_plan": {"x": "grouped_gemm"}}, r"ep_plan is set"),
    ({"pp_size": 8, "enable_sequence_parallel": True}, r"enable_sequence_parallel=True"),
    ({"pp_size": 8, "tp_plan": {"model.layers.*.mlp": "colwise"}},
     r"tp_plan=.*Transformers merges it into the model's own plan"),
    ({"pp_size": 8, "fsdp_plan": {"model.layers.*": "free_full_weight"}},
     r"fsdp_plan=.*pass sw.shard\(policy=...\)"),
    ({"pp_size": 8, "pipeline_schedule": "1F1B"}, r"unknown key\(s\) \['pipeline_schedule'\]"),
    ({"dp_replicate_size": 2, "fsdp_size": 4}, r"dp_replicate_size=2: shardwise replicates "
                                                r"across nodes"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        sw.from_config(config, env=EIGHT)


def test_one_process_and_the_fsdp_only_flags_give_notices():
    """In one process every size is a no-op (as in code); Transformers reads
    fsdp_cpu_offload and fsdp_mixed_precision for FSDP only."""
    alone = sw.from_config(DistributedConfig(pp_size=2, tp_size=2), env=sw.Env())
    assert configured(alone) == [sw.pipeline_parallel(size=2), sw.tensor_parallel(size=2)]
    assert "are for several processes" in alone.explain()
    split = sw.from_config({"tp_size": 8, "fsdp_mixed_precision": True}, env=EIGHT)
    assert configured(split) == [sw.tensor_parallel(size=8)]  # recognised by tp_size alone
    assert "fsdp_mixed_precision is not applied: Transformers reads it for FSDP only" in \
        split.explain()
