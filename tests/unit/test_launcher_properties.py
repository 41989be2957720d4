# Property-based tests: TrainingArguments mappings and accelerate launch variables, at random.
"""A mapping of ``TrainingArguments`` names with values of every type, and the variables
``accelerate launch`` sets with random text, each build a pipeline or are refused with a
``ShardwiseError`` naming the argument or the variable; never another exception.

The ci profile runs 60 examples a test (derandomized); the long run is
``HYPOTHESIS_PROFILE=long pytest -m long tests/unit/test_launcher_properties.py``.
"""
import pytest
from hypothesis import strategies as st
from test_config_properties import ENVS, SMALL, WRONG

import shardwise as sw
from shardwise.configs import accelerate_env
from shardwise.configs.training_args import ARGUMENTS, DEFAULTS
from shardwise.errors import ShardwiseError

from conftest import run_property, within

pytestmark = [pytest.mark.properties, pytest.mark.filterwarnings("ignore")]

#: values that mean something for some argument, so that deeper code is reached too
MEANINGFUL = st.sampled_from([
    True, False, 1, 2, 8, 0.5, 1.0, 1800, "steps", "no", "epoch", "full_shard auto_wrap",
    "shard_grad_op offload", "hybrid_shard", "tensorboard", "none", ["tensorboard"], "gloo",
    {"transformer_layer_cls_to_wrap": ["TinyDecoderBlock"], "activation_checkpointing": True},
    {"fsdp_min_num_params": 10, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"},
    {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"},
    {"non_blocking": True, "gradient_accumulation_kwargs": {"sync_with_dataloader": False}},
    {"even_batches": False}, "missing.json", "out"])
TWO = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
VARIABLES = sorted({*accelerate_env._FSDP, *accelerate_env._DEEPSPEED, *accelerate_env._TOP,
                    *accelerate_env._FLAGS, "ACCELERATE_SOMETHING_NEW"})
VARIABLE_VALUES = st.one_of(
    st.text(max_size=12), st.sampled_from([
        "true", "false", "True", "1", "0", "no", "bf16", "fp16", "fp8", "2", "3", "-1", "nan",
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP",
        "NO_WRAP", "TinyDecoderBlock", "cpu", "none", "nvme", "INDUCTOR", "x" * 5000, "ds.json"]))


def training_arguments_build_or_are_refused_by_name(data: st.DataObject) -> None:
    names = data.draw(st.lists(st.sampled_from(sorted(ARGUMENTS)), min_size=1, max_size=4,
                               unique=True))
    given_args = {n: data.draw(WRONG | SMALL | MEANINGFUL) for n in names}
    try:
        with within(20):
            pipe = sw.from_training_args(given_args, env=data.draw(st.sampled_from(ENVS)))
    except ShardwiseError as exc:
        text = str(exc)
        assert any(n in text for n in names) and len(text) < 2000, (given_args, text)
    else:
        assert isinstance(pipe, sw.Pipeline)
        # what a mapping leaves out is TrainingArguments' default
        if "max_steps" not in given_args and "num_train_epochs" not in given_args:
            assert pipe.fit_options["epochs"] == DEFAULTS["num_train_epochs"]


def launcher_variables_build_or_are_refused_by_name(data: st.DataObject) -> None:
    names = data.draw(st.lists(st.sampled_from(VARIABLES), min_size=1, max_size=5, unique=True))
    variables = {n: data.draw(VARIABLE_VALUES) for n in names}
    try:
        with within(20):
            sw.pipeline(sw.detect(environ={**TWO, **variables}))
    except ShardwiseError as exc:
        text = str(exc)
        assert any(n in text for n in names) and len(text) < 2000, (variables, text)


PROPERTIES = [training_arguments_build_or_are_refused_by_name,
              launcher_variables_build_or_are_refused_by_name]


@pytest.mark.parametrize("check", PROPERTIES, ids=[p.__name__ for p in PROPERTIES])
def test_property(check):
    run_property(check)


@pytest.mark.long
@pytest.mark.parametrize("check", PROPERTIES, ids=[p.__name__ for p in PROPERTIES])
def test_long_property(check):
    run_property(check, long=True)
