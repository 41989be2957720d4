# pipeline(): canonical order, contradictions, defaults for 1 and 2 processes, explain().
from typing import ClassVar

import attrs
import pytest
import torch

import shardwise as sw
from shardwise.errors import ConflictError, OptimizerError, PrecisionError
from shardwise.testing import TinyMLP, TinyTransformerLM
from shardwise.transforms import Stage, Transform

ONE = sw.Env()
TWO = sw.Env(world_size=2, rank=0, local_world_size=2, master_addr="127.0.0.1",
             master_port=1, launcher="torchrun")


@attrs.frozen(repr=False)
class OtherDistribution(Transform):
    """A user's own distribution transform (e.g. a research wrapper)."""

    stage: ClassVar[Stage] = Stage.DISTRIBUTION
    factory_name: ClassVar[str] = "other_distribution"

    def __call__(self, bundle):
        return self._record(bundle)


def names(pipe):
    return [type(t).__name__ for t in pipe.transforms]


def test_transforms_are_sorted_into_canonical_order():
    pipe = sw.pipeline(sw.replicate(), ONE, sw.clip_gradients(1.0), sw.accumulate_gradients(2),
                       sw.mixed_precision("bf16"))
    assert names(pipe) == ["ClipGradients", "AccumulateGradients", "MixedPrecision", "Replicate",
                           "Place", "DistributeData"]
    stages = [t.stage for t in pipe.transforms]
    assert stages == sorted(stages)


def test_default_for_one_process_has_no_wrapper_and_fp32_on_cpu():
    pipe = sw.pipeline(ONE)
    assert names(pipe) == ["MixedPrecision", "Place", "DistributeData"]
    assert pipe.transforms[0] == sw.mixed_precision("fp32")
    text = pipe.explain()
    assert "1 process(es)" in text
    assert "default: cpu has no fast native bf16" in text
    assert "replicate" not in text


def test_default_for_two_processes_replicates_and_says_why():
    pipe = sw.pipeline(TWO)
    assert names(pipe) == ["MixedPrecision", "Place", "DistributeData"]
    assert "distribution: chosen per model when called (2 processes, none given)" in pipe.explain()
    resolved = pipe.resolve(TinyTransformerLM())
    assert names(resolved) == ["MixedPrecision", "Replicate", "Place", "DistributeData"]
    text = resolved.explain()
    assert "default: 2 processes; device memory unknown, so replicate" in text
    assert "DistributedDataParallel over 2 ranks (gloo)" in text
    lines = text.splitlines()
    order = [i for i, line in enumerate(lines) if line.strip()[:2] in ("1.", "2.", "3.", "4.")]
    assert len(order) == 4
    assert pipe.explain(TinyTransformerLM()) == text


def two_with_memory(mib, device="cpu"):
    # per-rank budget: memory * 0.8, split by the node's 2 ranks on a CPU
    share = 2 if device == "cpu" else 1
    return attrs.evolve(TWO, device=torch.device(device),
                        device_memory_bytes=int(mib * 2**20 * share / 0.8))


BATCH = {"input_ids": torch.zeros(8, 16, dtype=torch.long),
         "labels": torch.zeros(8, 16, dtype=torch.long)}


# estimates for this model and batch: replicate 2.08 MiB, shard 1.77, shard + checkpointing
# 0.94, and with offload 0.52 on an accelerator (on a CPU offloading frees nothing)
@pytest.mark.parametrize("mib, device, chosen, said", [
    (100, "cpu", ["Replicate"], "replicate needs"),
    (1.9, "cpu", ["Shard"], "shard needs"),
    (1.2, "cpu", ["CheckpointActivations", "Shard"], "shard + checkpoint_activations needs"),
    (0.3, "cpu", ["CheckpointActivations", "Shard"], "none fits"),
    (0.7, "meta", ["Offload", "CheckpointActivations", "Shard"],
     "checkpoint_activations + offload needs"),
])
def test_default_distribution_follows_the_memory_estimate(mib, device, chosen, said):
    model = TinyTransformerLM(dim=32, layers=4)
    opt = torch.optim.AdamW(model.parameters())
    resolved = sw.pipeline(two_with_memory(mib, device)).resolve(model, opt, batch=BATCH)
    picked = [n for n in names(resolved) if n not in ("MixedPrecision", "Place", "DistributeData")]
    assert picked == chosen
    assert said in resolved.explain()
    assert ("offload" in resolved.explain()) == (device != "cpu")


def test_a_model_without_blocks_stays_replicated_when_memory_is_short():
    resolved = sw.pipeline(two_with_memory(0.0001)).resolve(TinyMLP())
    assert "Replicate" in names(resolved)
    assert "shard: no blocks to shard" in resolved.explain()


def test_explicit_replicate_in_one_process_says_no_wrapper():
    text = sw.pipeline(ONE, sw.replicate()).explain()
    assert "one process: no wrapper" in text
    assert "[default" not in text.split("replicate(")[1].splitlines()[0]


def test_no_env_calls_detect(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    env = sw.pipeline().env
    assert (env.world_size, env.rank, env.launcher) == (2, 1, "env")


def test_an_explicit_place_is_not_added_twice():
    pipe = sw.pipeline(ONE, sw.place())
    assert names(pipe).count("Place") == 1
    pipe(TinyMLP())


def test_same_transform_twice_is_refused_naming_both():
    with pytest.raises(ConflictError) as info:
        sw.pipeline(ONE, sw.clip_gradients(1.0), sw.clip_gradients(2.0))
    msg = str(info.value)
    assert "clip_gradients(max_norm=1.0, norm_type=2.0)" in msg
    assert "clip_gradients(max_norm=2.0, norm_type=2.0)" in msg and "keep one" in msg


def test_two_distribution_transforms_are_refused():
    with pytest.raises(ConflictError) as info:
        sw.pipeline(ONE, sw.replicate(), OtherDistribution())
    assert "replicate(" in str(info.value) and "other_distribution()" in str(info.value)
    assert "at most one distribution transform" in str(info.value)


def test_precision_the_device_cannot_do_is_refused():
    with pytest.raises(PrecisionError) as info:
        sw.pipeline(ONE, sw.mixed_precision("fp16"))
    msg = str(info.value)
    assert "mixed_precision(precision='fp16')" in msg and "cpu supports only 'fp32', 'bf16'" in msg
    assert isinstance(info.value, ValueError)


def test_two_envs_and_foreign_parts_are_refused():
    with pytest.raises(ConflictError, match="got 2 Envs"):
        sw.pipeline(ONE, ONE)
    with pytest.raises(TypeError, match="takes an Env and transforms .got 'bf16'"):
        sw.pipeline(ONE, "bf16")
    with pytest.raises(ValueError, match="'on_nonfinite' must be 'raise' or 'skip' .got 'warn'"):
        sw.pipeline(ONE, on_nonfinite="warn")


@pytest.mark.parametrize("make, message", [
    (lambda: sw.mixed_precision("fp8"), "precision='fp8'; accepted: 'bf16', 'fp16', 'fp32'"),
    (lambda: sw.accumulate_gradients(0), "'steps' must be an integer in [1, 2147483647] (got 0)"),
    (lambda: sw.accumulate_gradients(2.5), "(got 2.5)"),
    (lambda: sw.clip_gradients(-1), "'max_norm' must be a finite number > 0 (got -1)"),
    (lambda: sw.clip_gradients(1.0, norm_type=0), "'norm_type' must be a number > 0 or math.inf (got 0)"),
    (lambda: sw.replicate(bucket_mb=0), "'bucket_mb' must be a number in (0, 1048576] (got 0)"),
    (lambda: sw.replicate(static_graph="yes"), "'static_graph' must be a bool (got 'yes')"),
    (lambda: sw.distribute_data(seed="1"), "'seed' must be an integer in [-2**63, 2**63) (got '1')"),
])
def test_factories_validate_their_settings(make, message):
    with pytest.raises(sw.errors.ShardwiseError) as info:
        make()
    assert message in str(info.value)


def test_reprs_read_like_the_factory_call():
    assert repr(sw.accumulate_gradients(4)) == "accumulate_gradients(steps=4, sync_with_dataloader=True)"
    assert repr(sw.replicate(bucket_mb=50)).startswith("replicate(bucket_mb=50, ")


def test_a_transform_applied_twice_by_hand_is_refused():
    bundle = sw.Bundle(TinyMLP(), env=ONE)
    once = sw.accumulate_gradients(2)(bundle)
    assert once.plan.accumulation_steps == 2 and bundle.plan.accumulation_steps == 1
    with pytest.raises(ConflictError, match="was applied to this bundle already"):
        sw.accumulate_gradients(3)(once)


def test_applying_parts_by_hand_equals_the_pipeline():
    parts = [sw.mixed_precision("bf16"), sw.accumulate_gradients(2), sw.clip_gradients(0.5)]
    by_pipe = sw.pipeline(ONE, *parts)(TinyMLP())
    bundle = sw.Bundle(TinyMLP(), env=ONE)
    for part in parts + [sw.place()]:
        bundle = part(bundle)
    strip = {"applied"}
    assert attrs.asdict(by_pipe.plan, filter=lambda a, _: a.name not in strip) == \
        attrs.asdict(bundle.plan, filter=lambda a, _: a.name not in strip)


def test_optimizer_with_state_is_refused():
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8), torch.randn(2, 1)).backward()
    opt.step()
    with pytest.raises(OptimizerError, match="AdamW already holds state for 4 parameter"):
        sw.pipeline(ONE)(model, opt)


def test_optimizer_over_foreign_parameters_is_refused():
    opt = torch.optim.SGD(TinyMLP().parameters(), lr=0.1)
    with pytest.raises(OptimizerError, match="not in the model"):
        sw.pipeline(ONE)(TinyMLP(), opt)
