# Property-based tests: a config, mutated at random, builds a pipeline or is refused by name.
"""Real-shaped Accelerate YAML (FSDP, DeepSpeed, multi-GPU), DeepSpeed JSON and Transformers
``fsdp_config`` mappings are mutated at random (a value replaced by one of another type: a
bool, a string, a list, a mapping, None, NaN, inf, a negative or huge integer, a deep
nesting; a key dropped; an unknown key added) and handed to ``sw.from_config`` as a mapping
and as a file. Random bytes, random text and truncated files go to ``read_config``. Each
either builds, or raises a ``ShardwiseError`` whose message names the file and the key (a
short excerpt of the value at most); never another exception, never a hang.

The ci profile runs 60 examples a test (derandomized); the long run is
``HYPOTHESIS_PROFILE=long pytest -m long tests/unit/test_config_properties.py``: 2000 examples of
each property.
"""
import copy
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import strategies as st

import shardwise as sw
from shardwise import configs
from shardwise.configs import read_config
from shardwise.deepspeed_engine import settings as ds_settings
from shardwise.errors import ShardwiseError

from conftest import run_property, within

pytestmark = [pytest.mark.properties, pytest.mark.filterwarnings("ignore")]

#: envs the configs are read under: one CPU process, two, and four meta-device "GPUs"
ENVS = [sw.Env(), sw.Env(world_size=2, local_world_size=2),
        sw.Env(world_size=4, local_world_size=4, device="meta", precisions=("fp32", "bf16", "fp16"))]

ACCELERATE_FSDP = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP",
    "downcast_bf16": "no", "enable_cpu_affinity": False, "fsdp_config": {
        "fsdp_activation_checkpointing": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_version": 2},
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16",
    "num_machines": 1, "num_processes": 4, "rdzv_backend": "static", "same_network": True,
    "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False}
ACCELERATE_FSDP_V1 = {
    "distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 2, "fsdp_config": {
        "fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 100000,
        "fsdp_cpu_offload": True, "fsdp_use_orig_params": True, "fsdp_sync_module_states": True,
        "fsdp_forward_prefetch": False, "fsdp_state_dict_type": "FULL_STATE_DICT"}}
ACCELERATE_DEEPSPEED = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                         "offload_optimizer_device": "cpu", "offload_param_device": "none",
                         "zero3_init_flag": False, "zero_stage": 2},
    "mixed_precision": "fp16", "num_machines": 1, "num_processes": 8, "use_cpu": False}
ACCELERATE_MULTI_GPU = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "MULTI_GPU",
    "downcast_bf16": "no", "gpu_ids": "all", "machine_rank": 0, "main_training_function": "main",
    "mixed_precision": "no", "num_machines": 1, "num_processes": 2, "rdzv_backend": "static",
    "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    "use_cpu": False}
DEEPSPEED = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False}
TRANSFORMERS_FSDP = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "reshard_after_forward": False, "use_orig_params": True,
                     "activation_checkpointing": False, "cpu_ram_efficient_loading": False,
                     "forward_prefetch": False, "limit_all_gathers": True}
SEEDS = {"accelerate_fsdp": ACCELERATE_FSDP, "accelerate_fsdp_v1": ACCELERATE_FSDP_V1,
         "accelerate_deepspeed": ACCELERATE_DEEPSPEED, "accelerate_multi_gpu": ACCELERATE_MULTI_GPU,
         "deepspeed": DEEPSPEED, "transformers_fsdp": TRANSFORMERS_FSDP}


def _nested(depth: int) -> object:
    value: object = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def _keys(value: object) -> set[str]:
    """Every key of every mapping inside ``value``."""
    if isinstance(value, dict):
        return {str(k) for k in value} | {k for v in value.values() for k in _keys(v)}
    return set()


#: every key of the seeds, so that mutations also add keys that mean something elsewhere
KNOWN_KEYS = sorted(set().union(*map(_keys, SEEDS.values())))
SMALL = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.text(max_size=6),
                  st.sampled_from(["auto", "cpu", "nvme", "none", "NO_SHARD", "bf16", "true"]))
#: values of other types than a config holds, and values a reader must refuse
WRONG = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, -1, -10**9, 2**63, 10**40, 10**5000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.5, 0.5, 1e300]),
    st.text(max_size=12),
    st.sampled_from(["auto", "cpu", "nvme", "none", "NO", "FULL_SHARD", "NO_SHARD", "fp8",
                     "TRANSFORMER_BASED_WRAP", "NO_WRAP", "true", "false", "1", "-1", "nan",
                     "inf", "1e3", "0x10", "", " ", "x" * 500, "\x00", "ds.json", "."]),
    st.lists(SMALL, max_size=3), st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=4),
                                                  SMALL, max_size=3),
    st.integers(10, 20).map(_nested),
    st.just(list(range(5000))), st.just("y" * 100_000),
)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (a tuple of keys) to a value inside mappings, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    return out


def _at(config: dict, path: tuple) -> object:
    for key in path:
        config = config[key]
    return config


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, dict]:
    """A seed config with one to four random mutations."""
    name = draw(st.sampled_from(sorted(SEEDS)))
    config = copy.deepcopy(SEEDS[name])
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(_paths(config)))
        target = _at(config, path)
        op = draw(st.sampled_from(["replace", "drop", "add"] if path else ["add"]))
        if op == "add" and isinstance(target, dict):
            target[draw(st.sampled_from(KNOWN_KEYS) | st.text(min_size=1, max_size=8))] = \
                draw(WRONG | SMALL)
        elif op == "drop":
            del _at(config, path[:-1])[path[-1]]
        elif path:
            _at(config, path[:-1])[path[-1]] = draw(WRONG)
    return name, config


#: messages about the whole source rather than one key
WHOLE_SOURCE = ("cannot tell the format", "is not valid", "is not UTF-8", "nested more than",
                "must hold a mapping", "appears twice", "alias", "bytes; a config file")


def outcome(source: object, origins: tuple[str, ...], keys: set[str], env: sw.Env) -> str:
    """What ``from_config(source)`` gives: the transforms built (with the source's name
    replaced, so that a file and a mapping compare), or the name of the ShardwiseError raised,
    after checking that its message names the source (one of ``origins``) and a key (or is
    about the whole source) and is short."""
    try:
        with within(20):
            pipe = sw.from_config(source, env=env)
    except ShardwiseError as exc:
        message = str(exc)
        assert any(o in message for o in origins), f"{message!r} names none of {origins}"
        assert any(w in message for w in WHOLE_SOURCE) or any(k in message for k in keys) and \
            re.search(r"[\w.]+=|key", message), f"{message!r} names no key"
        assert len(message) < 2000, f"a {len(message)}-character message"
        return type(exc).__name__
    assert len(set(pipe.notes)) == len(pipe.notes), f"a notice given twice: {pipe.notes}"
    return repr(pipe.transforms).replace(origins[0], "<source>")


def _dump(config: dict, path: Path) -> bool:
    """Write ``config`` as JSON or YAML; False if it cannot be written (a huge integer)."""
    try:
        text = json.dumps(config) if path.suffix == ".json" else yaml.safe_dump(config)
    except ValueError:
        return False
    path.write_text(text)
    return True


def mutated_configs_build_or_are_refused_by_name(data: st.DataObject) -> None:
    """A mutated config, as a mapping and as a file, builds or is refused naming the key; both
    ways agree."""
    name, config = data.draw(mutated())
    env = data.draw(st.sampled_from(ENVS))
    keys = _keys(config) | {"deepspeed_config_file"}
    as_mapping = outcome(config, ("<mapping>",), keys, env)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("ds_config.json" if name == "deepspeed" else "config.yaml")
        if _dump(config, path):
            assert outcome(path, (str(path),), keys, env) == as_mapping


def deepspeed_files_named_by_accelerate_build_or_are_refused_by_name(data: st.DataObject) -> None:
    """An Accelerate YAML whose deepspeed_config names a mutated DeepSpeed JSON builds or is
    refused naming the key and the file that holds it."""
    _, inner = data.draw(mutated().filter(lambda named: named[0] == "deepspeed"))
    block = data.draw(st.fixed_dictionaries({}, optional={
        "zero_stage": st.integers(0, 3), "offload_optimizer_device": st.sampled_from(["none", "cpu"]),
        "offload_param_device": st.sampled_from(["none", "cpu"]),
        "gradient_accumulation_steps": st.integers(1, 4),
        "gradient_clipping": st.sampled_from([0.0, 1.0]) | WRONG}))
    precision = data.draw(st.sampled_from(["no", "fp16", "bf16"]))
    with tempfile.TemporaryDirectory() as tmp:
        ds, path = Path(tmp) / "ds.json", Path(tmp) / "config.yaml"
        config = {"distributed_type": "DEEPSPEED", "mixed_precision": precision,
                  "deepspeed_config": {**block, "deepspeed_config_file": "ds.json"}}
        if _dump(inner, ds) and _dump(config, path):
            outcome(path, (str(path), str(ds)), _keys(inner) | _keys(config), ENVS[2])


#: pieces of YAML and JSON syntax, tags and keys, joined at random into almost-configs
FRAGMENTS = ["distributed_type: ", "FSDP", "DEEPSPEED", "fsdp_config:", "deepspeed_config:",
             "zero_optimization", "{", "}", "[", "]", ":", ",", " ", "\n", "  ", "- ", '"', "'",
             "&a ", "*a", "<<: ", "? ", "!!binary ", "!!set ", "!!timestamp ", "!!float ",
             "!!int ", "!!python/object:os.system ", "!!omap ", "2020-01-01", ".nan", ".inf",
             "-1", "1e400", "0x", "null", "true", "~", "#", "%YAML 1.1\n", "---\n", "...\n",
             "stage", "offload_optimizer", "device", "cpu", "\t", "\\u0000", "\ufeff", "é"]
TEXT = st.one_of(st.text(max_size=200),
                 st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join))


def _truncated(data: st.DataObject) -> bytes:
    name = data.draw(st.sampled_from(sorted(SEEDS)))
    text = (json.dumps if name == "deepspeed" else yaml.safe_dump)(SEEDS[name]).encode()
    return text[:data.draw(st.integers(0, len(text)))]


def arbitrary_files_are_read_or_refused_by_name(data: st.DataObject) -> None:
    """Random bytes, random text and truncated configs are read, or refused naming the file."""
    raw = data.draw(st.one_of(st.binary(max_size=300), TEXT.map(str.encode),
                              st.just(b"").map(lambda _: _truncated(data))))
    suffix = data.draw(st.sampled_from([".yaml", ".json", ".yml", ""]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"config{suffix}"
        path.write_bytes(raw)
        try:
            with within(20):
                result = read_config(path, env=ENVS[0])
        except ShardwiseError as exc:
            assert str(path) in str(exc), f"{exc} does not name {path}"
            assert len(str(exc)) < 2000
        else:
            assert result.origin == str(path)


def ddp_arguments_build_or_are_refused_by_name(data: st.DataObject) -> None:
    """``sw.from_ddp_args`` with any values builds or names the argument."""
    name = data.draw(st.sampled_from(["ddp_backend", "ddp_find_unused_parameters",
                                      "ddp_bucket_cap_mb", "ddp_timeout", "ddp_broadcast_buffers"]))
    value = data.draw(WRONG | st.sampled_from(["gloo", "nccl", 1, 25.0, 3600]))
    try:
        with within(20):
            sw.from_ddp_args(**{name: value}, env=ENVS[1])
    except ShardwiseError as exc:
        assert name in str(exc) and len(str(exc)) < 2000, str(exc)


#: blocks whose keys are free (their content gives one notice, or none, as a whole)
FREE = {"optimizer", "scheduler", "tpu_env"}
#: every key some reader takes, in any block (an added key outside these is unknown)
TAKEN = (configs.accelerate.TOP | ds_settings.BLOCK_KEYS | ds_settings.TOP
         | set(ds_settings.TUNING) | {"stage", "offload_optimizer", "offload_param", "device",
                                      "enabled"}
         | {k for shapes in ds_settings.OFFLOAD_TUNING.values() for k in shapes}
         | {k for shapes in ds_settings.PRECISION_TUNING.values() for k in shapes})
UNKNOWN = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(
    lambda k: k not in TAKEN and k.removeprefix("fsdp_") not in configs.fsdp.KEYS
    and not k.startswith("tpu_"))


def unknown_keys_are_refused_naming_them(data: st.DataObject) -> None:
    """A key no reader takes, added to any block a reader interprets, is refused by name."""
    name = data.draw(st.sampled_from(sorted(SEEDS)))
    config = copy.deepcopy(SEEDS[name])
    blocks = [p for p in _paths(config) if isinstance(_at(config, p), dict) and not FREE & set(p)]
    key = data.draw(UNKNOWN)
    _at(config, data.draw(st.sampled_from(blocks)))[key] = data.draw(SMALL)
    with pytest.raises(ShardwiseError, match=f"unknown key\\(s\\) \\[{key!r}\\]"):
        sw.from_config(config, env=ENVS[2])


PROPERTIES = [mutated_configs_build_or_are_refused_by_name,
              deepspeed_files_named_by_accelerate_build_or_are_refused_by_name,
              arbitrary_files_are_read_or_refused_by_name,
              ddp_arguments_build_or_are_refused_by_name,
              unknown_keys_are_refused_naming_them]


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_the_seed_configs_build(name):
    assert isinstance(sw.from_config(SEEDS[name], env=ENVS[2]), sw.Pipeline)


@pytest.mark.parametrize("check", PROPERTIES, ids=[p.__name__ for p in PROPERTIES])
def test_property(check):
    run_property(check)


@pytest.mark.long
@pytest.mark.parametrize("check", PROPERTIES, ids=[p.__name__ for p in PROPERTIES])
def test_long_property(check):
    run_property(check, long=True)
