# sw.compile() in one process: one graph per distinct block, equal to eager; settings, backends, recompiles.
import importlib.metadata
import importlib.util
import logging

import pytest
import torch
import torch._dynamo
import yaml

import shardwise as sw
from shardwise.errors import ArgumentError, ConfigError, ConflictError
from shardwise.testing import TinyTransformerLM, max_param_diff

from _compiling import train
from conftest import ONE


def test_regional_compile_is_one_graph_per_distinct_block_and_equals_eager(eager):
    compiled = train([sw.compile(backend="aot_eager")])
    assert compiled["graphs"] == 1  # two identical layers, one graph
    assert max_param_diff(compiled["params"], eager[4]["params"]) <= 1e-5
    assert compiled["names"] == eager[4]["names"]  # no _orig_mod in names or checkpoints
    four = train([sw.compile(backend="aot_eager")], layers=4)
    assert four["graphs"] == 1  # flat in the number of layers
    whole = train([sw.compile(backend="aot_eager", regional=False)])
    assert max_param_diff(whole["params"], eager[4]["params"]) <= 1e-5


def test_a_transformers_llama_is_one_graph_too(caplog):
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    counters.clear()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2))
    bundle = sw.pipeline(ONE, sw.compile(backend="aot_eager"))(
        model, torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 64, (2, 8))
    bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    # the KV cache a training forward builds would make each layer a graph of its own
    assert counters["stats"]["unique_graphs"] == 1
    assert model.config.use_cache is False and "set it back before generate()" in caplog.text


def test_inductor_equals_eager(eager):
    compiled = train([sw.compile()])  # inductor, the default
    assert max_param_diff(compiled["params"], eager[4]["params"]) <= 1e-5
    assert "regional torch.compile" in compiled["explain"]


def test_a_nonfinite_step_is_caught_under_compile():
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=32, heads=2, layers=2)
    bundle = sw.pipeline(ONE, sw.compile(backend="aot_eager"))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    state, _ = bundle.step(bundle.init(), {"input_ids": ids, "labels": ids})
    with torch.no_grad():
        model.layers[0].mlp[0].weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state, _ = bundle.step(state, {"input_ids": ids, "labels": ids})
    with pytest.raises(sw.errors.NonFiniteError, match="optimizer step 2"):
        bundle.check(state)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or k == "layers.0.mlp.0.weight" for k in before)


def test_compile_sits_between_checkpointing_and_distribution():
    pipe = sw.pipeline(sw.Env(world_size=2, local_world_size=2), sw.shard(), sw.compile(),
                       sw.checkpoint_activations())
    order = [t.factory_name for t in pipe.transforms]
    assert order.index("checkpoint_activations") < order.index("compile") < order.index("shard")


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ArgumentError, match=r"compile\(\) 'mode' must be None or one of"):
        sw.compile(mode="fast")
    with pytest.raises(ArgumentError, match=r"'backend' 'turbo' is not a torch.compile backend"):
        sw.pipeline(ONE, sw.compile(backend="turbo"))
    with pytest.raises(ConflictError, match="'inductor' backend fail in backward"):
        sw.pipeline(ONE, sw.compile(), sw.tensor_parallel())
    sw.pipeline(ONE, sw.compile(backend="eager"), sw.tensor_parallel())  # dynamo alone works
    with pytest.raises(ConflictError, match="DeepSpeed"):
        sw.pipeline(ONE, sw.compile(), sw.deepspeed({"train_micro_batch_size_per_gpu": 1}))
    model = TinyTransformerLM()
    bundle = sw.compile(backend="eager")(sw.Bundle(model, env=ONE))
    with pytest.raises(ConflictError, match="compiled already"):
        sw.compile(backend="eager")(sw.Bundle(bundle.model, env=ONE))


def test_configs_build_compile(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "NO", "dynamo_config": {
        "dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune", "dynamo_use_fullgraph": True,
        "dynamo_use_regional_compilation": True}}))
    assert sw.compile(backend="inductor", mode="max-autotune", fullgraph=True) in \
        sw.from_config(path, env=ONE).transforms
    args = sw.from_training_args({"torch_compile_backend": "aot_eager"}, env=ONE)
    assert sw.compile(backend="aot_eager", regional=False) in args.transforms
    path.write_text(yaml.safe_dump({"distributed_type": "NO",
                                    "dynamo_config": {"dynamo_backend": "TURBO"}}))
    with pytest.raises(ConfigError, match=r"dynamo_config.dynamo_backend='TURBO'"):
        sw.from_config(path, env=ONE)
    if importlib.util.find_spec("tvm") is None and "tvm" in torch._dynamo.list_backends(
            exclude_tags=()):  # listed by torch, its package missing: named at the key
        path.write_text(yaml.safe_dump({"distributed_type": "NO",
                                        "dynamo_config": {"dynamo_backend": "TVM"}}))
        with pytest.raises(ConfigError, match=r"dynamo_config.dynamo_backend='TVM' is not "
                                              r"accepted; .*tvm cannot: its package tvm is not"):
            sw.from_config(path, env=ONE)


@pytest.mark.parametrize(("backend", "package"), [("tvm", "tvm"), ("openxla", "torch_xla")])
def test_a_listed_backend_whose_package_is_missing_is_refused_when_built(backend, package):
    if backend not in torch._dynamo.list_backends(exclude_tags=()) or importlib.util.find_spec(package):
        pytest.skip(f"torch does not list {backend} here, or {package} is installed")
    step = sw.compile(backend=backend)  # construction checks the name's shape only
    with pytest.raises(ArgumentError, match=rf"compile\(\) 'backend' '{backend}' cannot compile "
                                            rf"here: its package {package} is not installed; "
                                            r"backends that work here: .*\beager\b.*inductor"):
        sw.pipeline(ONE, step)


def test_a_backend_plugin_that_fails_to_load_is_refused_when_built(monkeypatch):
    from torch._dynamo.backends import registry

    torch._dynamo.list_backends()  # torch's own backends registered first
    plugin = importlib.metadata.EntryPoint(name="broken", group="torch_dynamo_backends",
                                           value="shardwise_no_such_plugin.backend:compiler")
    monkeypatch.setitem(registry._BACKENDS, "broken", plugin)
    with pytest.raises(ArgumentError, match=r"'broken' cannot compile here: it fails to load "
                                            r"\(ModuleNotFoundError: .*shardwise_no_such_plugin"):
        sw.pipeline(ONE, sw.compile(backend="broken"))
    sw.pipeline(ONE, sw.compile(backend="eager"))  # a backend that loads is accepted


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def recompile_limit_warnings(caplog, compiled, lengths=(8, 9, 10)):
    """(shardwise's warnings about the recompile limit, torch's) while ``compiled`` (a
    callable taking token ids) runs on inputs of each length, the limit at 1."""
    torch._dynamo.reset()
    caplog.clear()
    torchs = Records()  # on torch's logger itself: whether it propagates is torch's choice
    logging.getLogger("torch._dynamo").addHandler(torchs)
    try:
        with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
            for length in lengths:
                compiled(torch.randint(0, 32, (2, length)))
    finally:
        logging.getLogger("torch._dynamo").removeHandler(torchs)
    ours = [r.getMessage() for r in caplog.records
            if r.name.startswith("shardwise") and "recompile limit" in r.getMessage()]
    return ours, [m for m in torchs.messages if "hit config.recompile_limit" in m]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_hitting_the_recompile_limit_is_said_naming_the_block_and_the_guard(caplog, checkpointed):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    parts = [sw.checkpoint_activations()] if checkpointed else []
    sw.pipeline(ONE, sw.compile(backend="eager", dynamic=False), *parts)(
        model, torch.optim.SGD(model.parameters(), lr=0.1))
    said, _ = recompile_limit_warnings(caplog, model)
    # once: past the limit torch runs the blocks' shared code eagerly, compiling nothing more
    assert len(said) == 1, said
    assert said[0].startswith("compile(): layers.0 (TinyDecoderBlock) hit torch's recompile "
                              "limit (torch._dynamo.config.recompile_limit=1)")
    assert "the guard that changed: 0/0: tensor" in said[0]
    assert "size mismatch at index 1. expected 8, actual 9" in said[0]
    assert "runs it eagerly" in said[0] and "compile(dynamic=True)" in said[0]


def test_the_recompile_limit_of_code_shardwise_did_not_compile_is_left_to_torch(caplog):
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2)
    sw.pipeline(ONE, sw.compile(backend="eager"))(model, torch.optim.SGD(model.parameters()))
    mine = torch.compile(lambda ids: ids * 2, backend="eager", dynamic=False)
    said, torchs = recompile_limit_warnings(caplog, mine)
    assert said == [] and len(torchs) == 1  # torch hit the limit, and says so itself
