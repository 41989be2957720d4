# Property-based tests: every transform factory, detect() override, launcher variable and pipeline
# call argument either builds or raises a shardwise error naming what was wrong.
import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.errors import ShardwiseError
from shardwise.transforms import Transform

pytestmark = [pytest.mark.properties, pytest.mark.filterwarnings("ignore")]

#: values of every kind a caller might pass by mistake
ANY_VALUE = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**80, max_value=2**80),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 10**5000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e300]),
    st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.just(object()), st.just(torch.zeros(2)), st.just(torch.device("meta")),
)

#: the required arguments of factories that have some, with valid values
REQUIRED = {"accumulate_gradients": {"steps": 2}, "clip_gradients": {"max_norm": 1.0}}

FACTORIES = [sw.replicate, sw.shard, sw.mixed_precision, sw.offload, sw.checkpoint_activations,
             sw.accumulate_gradients, sw.clip_gradients, sw.distribute_data, sw.place,
             sw.shard_optimizer]
CASES = [(factory, field.name) for factory in FACTORIES for field in attrs.fields(factory)]


def _names_it(exc: BaseException, *words: str) -> None:
    message = str(exc)
    assert any(word in message for word in words), f"{message!r} names none of {words}"
    assert len(message) < 2000, f"a {len(message)}-character message"


@pytest.mark.parametrize(("factory", "name"), CASES,
                         ids=[f"{f.factory_name}.{n}" for f, n in CASES])
@given(value=ANY_VALUE)
def test_every_transform_option_builds_or_is_refused_by_name(factory, name, value):
    kwargs = {**REQUIRED.get(factory.factory_name, {}), name: value}
    try:
        transform = factory(**kwargs)
    except ShardwiseError as exc:
        _names_it(exc, f"'{name}'", name)
        return
    assert isinstance(transform, Transform)
    # what was accepted must hold up in a pipeline on this machine: valid, or refused by name
    try:
        sw.pipeline(sw.Env(), transform)
    except ShardwiseError as exc:
        _names_it(exc, factory.factory_name, name, str(value)[:20])


def test_the_bounds_refused_at_construction_are_the_ones_that_failed_late():
    with pytest.raises(sw.errors.ArgumentError, match="'steps' must be an integer in"):
        sw.accumulate_gradients(10**30)
    with pytest.raises(sw.errors.ArgumentError, match="'seed' must be an integer in"):
        sw.distribute_data(seed=2**70)
    with pytest.raises(sw.errors.ArgumentError, match="'max_norm' must be a finite number"):
        sw.clip_gradients(math.inf)
    with pytest.raises(sw.errors.ArgumentError, match="'bucket_mb'"):
        sw.replicate(bucket_mb=math.nan)
    assert sw.clip_gradients(1.0, norm_type=math.inf).norm_type == math.inf  # a real norm
    # still the exception types they were before: except TypeError / ValueError keep working
    with pytest.raises(TypeError):
        sw.replicate(static_graph="yes")
    with pytest.raises(ValueError):
        sw.accumulate_gradients(0)


OVERRIDES = ["world_size", "rank", "local_rank", "local_world_size", "node_rank", "num_nodes",
             "master_addr", "master_port", "device", "backend", "precisions", "timeout"]


@pytest.mark.parametrize("name", OVERRIDES)
@given(value=ANY_VALUE)
def test_every_detect_override_builds_or_is_refused_by_name(name, value):
    try:
        env = sw.detect(environ={}, **{name: value})
    except ShardwiseError as exc:
        _names_it(exc, f"'{name}'", name)
        return
    assert isinstance(env, sw.Env)


def test_detect_refuses_what_used_to_fail_late():
    with pytest.raises(sw.errors.EnvError, match="'timeout' must be a finite"):
        sw.detect(environ={}, timeout=math.nan)
    if not torch.cuda.is_available():
        with pytest.raises(sw.errors.EnvError, match="'device'='cuda' is not available"):
            sw.detect(environ={}, device="cuda")
    with pytest.raises(sw.errors.EnvError, match="'master_port'"):
        sw.detect(environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_PORT": "99999"})


VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_PORT"]
TEXT = st.one_of(st.text(max_size=12), st.integers(-5, 70000).map(str),
                 st.sampled_from(["0", "1", "2", "-1", "1e3", " 1", "0x1", "99999", "nan"]))


@given(variables=st.dictionaries(st.sampled_from(VARIABLES), TEXT, min_size=1))
def test_launcher_variables_build_an_env_or_are_refused_by_name(variables):
    environ = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **variables}
    try:
        env = sw.detect(environ=environ)
    except ShardwiseError as exc:
        _names_it(exc, *variables, *(v.lower() for v in variables), "rank", "world_size",
                  "port", "local")
        return
    assert 0 <= env.rank < env.world_size and 0 <= env.local_rank < env.local_world_size


CALL_ARGS = ["optimizer", "loader", "scheduler", "loss_fn", "eval_loader"]


@pytest.mark.parametrize("name", CALL_ARGS)
@given(value=ANY_VALUE)
def test_pipeline_call_arguments_are_checked_before_anything_changes(name, value):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), name: value}
    try:
        sw.pipeline(sw.Env())(model, **kwargs)
    except ShardwiseError as exc:
        _names_it(exc, f"'{name}'", name)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_scheduler_that_is_not_one_is_refused_before_the_first_step():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sw.errors.ArgumentError, match="'scheduler' must be an LR scheduler"):
        sw.pipeline(sw.Env())(model, optimizer, scheduler="cosine")
    assert len(optimizer.state) == 0


FIT_ARGS = ["epochs", "steps", "checkpoint_every", "keep_last", "eval_every", "log_every",
            "eval_fn", "loggers", "progress", "state"]


@pytest.mark.parametrize("name", FIT_ARGS)
@given(value=ANY_VALUE)
def test_fit_arguments_are_checked_before_the_first_step(name, value):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   [torch.ones(2, 2)] * 3, loss_fn=lambda m, b: m(b).sum())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = {"epochs": 1, "steps": 1, "progress": False, name: value}
    try:
        sw.fit(bundle, **kwargs)
    except ShardwiseError as exc:
        _names_it(exc, f"'{name}'", name)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fit_refuses_a_bad_checkpoint_setting_before_training(tmp_path):
    model = torch.nn.Linear(2, 1)
    bundle = sw.pipeline(sw.Env())(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   [torch.ones(2, 2)] * 3, loss_fn=lambda m, b: m(b).sum())
    with pytest.raises(sw.errors.ArgumentError, match="'keep_last' must be an integer >= 1"):
        sw.fit(bundle, epochs=1, checkpoint_dir=tmp_path, keep_last=0, progress=False)
    with pytest.raises(sw.errors.ArgumentError, match="'checkpoint_dir' must be a path"):
        sw.fit(bundle, epochs=1, checkpoint_dir=3, progress=False)
    with pytest.raises(sw.errors.ArgumentError, match="need a 'checkpoint_dir'"):
        sw.fit(bundle, epochs=1, checkpoint_every=2, progress=False)
    assert not any(tmp_path.iterdir())
