# The shape of the package: no import cycles, test helpers out of production imports, the engine seam.
import ast
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import shardwise
import shardwise as sw
from shardwise.engines import LocalEngine, MemoryParts
from shardwise.engines.step_hooks import Backward, WindowEnd
from shardwise.testing import TinyMLP
from shardwise.transforms.base import Distribution

SRC = Path(shardwise.__file__).parent


def module_name(path):
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules):
    """The shardwise modules ``path`` imports, at the top, inside functions and under
    ``if TYPE_CHECKING:`` alike (a type-only import still ties the two modules together)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from a import b` imports the module a.b when there is one, else a name of a
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_no_import_cycles_in_the_package():
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: imports_of(path, files) - {name} for name, path in files.items()}
    # a package imports its own __init__ first: count an import of a.b.c as one of a.b too
    for name in list(graph):
        for dep in list(graph[name]):
            parent = dep.rpartition(".")[0]
            while parent and parent != name and not name.startswith(parent + "."):
                graph[name].add(parent)
                parent = parent.rpartition(".")[0]
        graph[name] = {d for d in graph[name] if d in files and d != name}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_nothing_in_production_imports_the_test_helpers():
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    users = sorted(n for n, p in files.items() if n != "shardwise.testing"
                   and "shardwise.testing" in imports_of(p, files))
    assert users == []
    code = "import sys, shardwise; print('shardwise.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the engine seam: a new engine is one engine class plus its transform -----------------

CALLS = []


@attrs.frozen
class RecordingEngine(LocalEngine):
    """One process, but it says what the step and the estimate asked of it."""

    name = "recording"

    def no_sync(self, model, state):
        CALLS.append(("no_sync", state.micro_step))
        return None

    def memory(self, model, env, **kwargs):
        CALLS.append(("memory", kwargs["accumulating"]))
        return MemoryParts(1, 2, 3, 4, "recorded")


@attrs.frozen(repr=False)
class Recording(Distribution):
    factory_name = "recording"

    def engine(self, env, plan):
        return RecordingEngine()

    def __call__(self, bundle):
        return attrs.evolve(self._record(bundle), engine=self.engine(bundle.env, bundle.plan))


def test_a_new_engine_plugs_in_without_touching_the_step_or_the_estimate():
    CALLS.clear()
    pipe = sw.pipeline(sw.Env(), Recording(), sw.accumulate_gradients(2))
    estimate = sw.estimate_memory(TinyMLP(), pipe)
    assert (estimate.total_bytes, estimate.layout) == (10, "recorded")
    model = TinyMLP()
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(bundle.engine, RecordingEngine)
    state = bundle.init()
    for _ in range(4):
        state, _ = bundle.step(state, (torch.randn(4, 8), torch.randn(4, 1)))
    # asked before each micro-batch that does not end a window
    assert CALLS == [("memory", True), ("no_sync", 0), ("no_sync", 2)]
    assert state.step == 2


class OwnStepEngine(LocalEngine):
    """An engine that drives the step itself, as DeepSpeed's and a pipeline schedule's do:
    its own backward (the loss doubled, then halved in its update) and its own update."""

    def backward(self, run, state, batch, micro):
        CALLS.append(("backward", micro.index, micro.boundary))
        loss = torch.nn.functional.mse_loss(run.model(batch[0]), batch[1])
        (loss * 2).backward()
        return Backward(loss.detach(), synced=micro.boundary)

    def end_window(self, run, state, done, micro):
        CALLS.append(("end_window", micro.batches))
        with torch.no_grad():
            for p in run.params:
                p -= 0.1 * p.grad / (2 * micro.batches)
        run.optimizer.zero_grad(set_to_none=True)
        return WindowEnd(norm=torch.tensor(1.5))


@attrs.frozen(repr=False)
class OwnStep(Distribution):
    factory_name = "own_step"

    def engine(self, env, plan):
        return OwnStepEngine()

    def __call__(self, bundle):
        return attrs.evolve(self._record(bundle), engine=self.engine(bundle.env, bundle.plan))


def test_an_engine_that_owns_its_step_gets_the_same_state_and_result_as_a_native_one():
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    runs = {}
    for name, dist_ in (("own", OwnStep()), ("native", None)):
        torch.manual_seed(0)
        model = TinyMLP()
        parts = [sw.Env(), sw.accumulate_gradients(2)] + ([dist_] if dist_ else [])
        bundle = sw.pipeline(*parts)(model, torch.optim.SGD(model.parameters(), lr=0.1))
        CALLS.clear()
        state, outs = bundle.init(), []
        for batch in batches:
            state, out = bundle.step(state, batch)
            outs.append(out)
        runs[name] = (state, outs, [p.detach().clone() for p in model.parameters()], CALLS[:])
    own, native = runs["own"], runs["native"]
    assert own[3] == [("backward", 1, False), ("backward", 2, True), ("end_window", 2),
                      ("backward", 3, False), ("backward", 4, True), ("end_window", 2)]
    # the skeleton built the state and outputs: the same as the native step's
    assert (own[0].step, own[0].micro_step, own[0].window_batches) == (2, 4, 0)
    assert (own[0].step, own[0].micro_step, own[0].synced) == (
        native[0].step, native[0].micro_step, native[0].synced)
    assert [o.stepped for o in own[1]] == [o.stepped for o in native[1]] == [False, True] * 2
    assert [float(o.loss) for o in own[1]] == pytest.approx([float(o.loss) for o in native[1]])
    assert [o.grad_norm for o in own[1][::2]] == [None, None]
    assert float(own[1][1].grad_norm) == 1.5
    for mine, theirs in zip(own[2], native[2], strict=True):
        torch.testing.assert_close(mine, theirs)


def test_only_the_step_skeleton_builds_the_next_state():
    builders = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "TrainState", "StepOutput") and (node.args or node.keywords):
                builders.setdefault(module_name(path), set()).add(node.func.id)
    # bundle.init() and sw.load build a fresh TrainState() without arguments
    assert builders == {"shardwise.step": {"TrainState", "StepOutput"}}


def test_import_shardwise_is_light_and_its_functions_keep_their_names():
    """``import shardwise`` imports no torch (``shardwise --help`` starts at once); importing
    the modules that hold ``fit``, ``pipeline`` and ``export`` leaves them the functions."""
    code = ("import sys, shardwise; assert 'torch' not in sys.modules, 'torch imported'\n"
            "import shardwise.loop, shardwise.configured, shardwise.checkpoint.full_weights\n"
            "import shardwise as sw\n"
            "assert all(callable(f) for f in (sw.fit, sw.pipeline, sw.export))\n"
            "from shardwise.loop import fit\n"
            "assert fit is sw.fit and 'torch' in sys.modules\n"
            "assert sorted(n for n in sw.__all__ if getattr(sw, n, None) is None) == []\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_one_list_of_public_names_serves_all_and_the_type_checkers_stub():
    """``shardwise.PUBLIC`` is the only list: ``__all__`` and ``__init__.pyi`` come from it,
    and no module of the package shares its name with a public function (importing any
    module ``x`` as ``import shardwise.x as m`` gives that module, and hides nothing)."""
    import types
    from pathlib import Path

    import shardwise as sw

    tools = Path(__file__).resolve().parents[2] / "tools"
    done = subprocess.run([sys.executable, str(tools / "public_stub.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert set(sw.__all__) == {*sw.PUBLIC, "__version__"} - {"testing"}
    for name, module in sw.PUBLIC.items():  # each name listed with the module defining it
        obj = getattr(sw, name)
        if isinstance(obj, type) or isinstance(obj, types.FunctionType):
            assert obj.__module__ == module, (name, module, obj.__module__)
    # every module at every depth, reached the way `import shardwise.a.b as m` reaches it:
    # attribute by attribute from the package (a re-exported function would win there)
    code = (
        "import importlib, pkgutil, types, shardwise as sw\n"
        "names = [m.name for m in pkgutil.walk_packages(sw.__path__, 'shardwise.')\n"
        "         if not m.name.endswith('.__main__')]\n"
        "assert {'shardwise.transforms.sharding', 'shardwise.checkpoint.restore'} <= set(names)\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "for name in names:\n"
        "    found = sw\n"
        "    for part in name.split('.')[1:]:\n"
        "        found = getattr(found, part)\n"
        "    assert isinstance(found, types.ModuleType) and found.__name__ == name, (name, found)\n")
    code += "assert all(not isinstance(getattr(sw, n), types.ModuleType) or sw.PUBLIC[n] == '' " \
            "for n in sw.PUBLIC)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert isinstance(sw.errors, types.ModuleType) and callable(sw.fit)


ENVIRON_READERS = {"shardwise.env", "shardwise.testing", "shardwise.deepspeed_engine.launch_env"}


def test_the_environment_is_read_in_env_py_the_cli_and_the_test_harness_only():
    """``os.environ`` and ``os.getenv`` appear in env.py (read once, into Env), cli/ (the
    launcher sets the children's variables), testing.py (spawning ranks) and one DeepSpeed
    helper (DeepSpeed reads its ranks from variables); everything else asks the Env."""
    readers = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "os" and node.attr in ("environ", "getenv", "putenv"):
                readers.add(module_name(path))
    outside = {m for m in readers - ENVIRON_READERS if not m.startswith("shardwise.cli")}
    assert outside == set(), f"modules reading the environment outside env.py: {sorted(outside)}"
    assert "shardwise.env" in readers  # the check sees what it looks for


def test_module_state_lives_in_named_records():
    """No module keeps mutable state in a bare module-level list, dict or set that it
    changes (`global x`, `x.append(...)`): such state lives in one named record per concern
    (``distributed._MEMBERSHIP``, ``checkpoint.background._IN_FLIGHT``,
    ``checkpoint.lock._WRITERS``), which says what it holds."""
    found = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        bare = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name) and isinstance(node.value, (ast.List, ast.Dict,
                                                                       ast.Set))}
        inside = [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))
                  for n in ast.walk(f)]  # a table built once at import is not state
        for node in inside:
            if isinstance(node, ast.Global):
                found += [f"{module_name(path)}: global {', '.join(node.names)}"]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id in bare and \
                    node.func.attr in ("append", "add", "update", "pop", "clear", "extend",
                                       "setdefault", "remove", "insert"):
                found += [f"{module_name(path)}: {node.func.value.id}.{node.func.attr}()"]
    assert found == [], found


def test_configs_and_the_deepspeed_engine_depend_in_one_direction():
    """The config readers may build DeepSpeed's transform; DeepSpeed's engine never reads a
    config format (what both need, like a file named by a key, is in ``_config_source``)."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    engine = {m for m in files if m.startswith("shardwise.deepspeed_engine")}
    readers = {m for m in files if m.startswith("shardwise.configs")}
    back = sorted((m, d) for m in engine for d in imports_of(files[m], files) if d in readers)
    assert back == [], f"deepspeed_engine imports the config readers: {back}"
    assert any(d in engine for m in readers for d in imports_of(files[m], files))


def test_deepspeed_auto_is_defined_once():
    """One spelling of DeepSpeed's ``"auto"``, in ``deepspeed_engine/settings.py`` (the one
    DeepSpeed config reader), which both of its outputs compare with."""
    definitions = []
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and "AUTO" in t.id and not t.id.endswith("NOTICE")
                    for t in node.targets):
                definitions.append(f"{module_name(path)}: {ast.unparse(node)[:60]}")
            if isinstance(node, ast.ClassDef) and node.name.lstrip("_").lower() == "auto" \
                    and "policies" not in path.name:  # policies.auto() picks blocks: not this
                definitions.append(f"{module_name(path)}: class {node.name}")
    assert definitions == ["shardwise.deepspeed_engine.settings: AUTO = 'auto'"], definitions


#: keys of a DeepSpeed JSON whose values shardwise reads
DEEPSPEED_KEYS = {"zero_optimization", "offload_optimizer", "offload_param", "stage", "fp16",
                  "bf16", "bfloat16", "gradient_accumulation_steps", "gradient_clipping",
                  "train_batch_size", "train_micro_batch_size_per_gpu"}


def test_one_reader_reads_a_deepspeed_config():
    """A DeepSpeed config's values are read in ``deepspeed_engine/settings.py`` only (both
    outputs take its settings records); ``auto.py`` opens only the blocks it writes the
    resolved values into. (TrainingArguments' own fields share some of the names: its
    reader is not looked at; lookups in a reader's settings records are not reads.)"""
    readers: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name.startswith("training_args"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key, of = None, None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key, of = node.slice, node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "pop") and node.args:
                key, of = node.args[0], node.func.value
            if getattr(of, "id", None) in SETTINGS_RECORDS:
                continue
            if isinstance(key, ast.Constant) and key.value in DEEPSPEED_KEYS:
                readers.setdefault(module_name(path), set()).add(key.value)
    assert readers.pop("shardwise.deepspeed_engine.auto") <= {"fp16", "bf16", "bfloat16",
                                                              "zero_optimization"}
    assert set(readers) == {"shardwise.deepspeed_engine.settings"}, readers


#: the names a reader gives its settings records (``Settings``), which are not configs
SETTINGS_RECORDS = {"settings", "said", "merged", "theirs", "mine"}


def test_no_caller_tells_where_an_error_came_from_by_its_text():
    """Where an error came from travels as data (``ShardwiseError.origin``), never found by
    searching or rewriting its message. One module reads a foreign error's text: batch_size
    recognises running out of memory, which torch's CPU allocator raises as a plain
    RuntimeError ("DefaultCPUAllocator: can't allocate memory"), as Accelerate does."""
    found = []
    for path in SRC.rglob("*.py"):
        if module_name(path) == "shardwise.batch_size":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node) if isinstance(node, (ast.Compare, ast.Call)) else ""
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                     for op in node.ops) and "str(exc)" in text:
                found.append(f"{module_name(path)}: {text[:80]}")
            if isinstance(node, ast.Call) and text.startswith("str(exc).replace"):
                found.append(f"{module_name(path)}: {text[:80]}")
    assert found == [], found


def test_a_config_error_carries_its_origin():
    from shardwise.errors import ConfigError

    try:
        sw.from_training_args({"ddp_timeout": -1})
    except ConfigError as exc:
        assert exc.origin == "training arguments <mapping>"
        assert str(exc).startswith("training arguments <mapping>: ddp_timeout=-1")
    else:
        raise AssertionError("ddp_timeout=-1 was accepted")


def test_the_combinator_knows_no_config_format():
    """``pipelines.py`` (Pipeline, the canonical order, the defaults, ``assemble``) imports no
    config reader, not even lazily; the entry points that read configs (``pipeline()``,
    ``from_config``, ...) live in ``configured.py`` above both."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    readers = sorted(d for d in imports_of(files["shardwise.pipelines"], files)
                     if d.startswith(("shardwise.configs", "shardwise.deepspeed_engine")))
    assert readers == []
    assert "shardwise.pipelines" in imports_of(files["shardwise.configured"], files)


def test_config_readers_take_an_env_and_name_keys_as_written():
    """The config readers (``configs/``, ``deepspeed_engine/``, the Trainer seam) take the Env
    an entry point made (``given_or_detected`` in ``configured.py``) and never detect one;
    a reading is never branched for the Trainer (``for_trainer`` filters what the one
    reading gives); no message text is rewritten (a key's name as the user wrote it, an
    ``accelerate launch`` variable, travels in the Source: ``Source.key``)."""
    found = []
    for path in SRC.rglob("*.py"):
        name = module_name(path)
        if not name.startswith(("shardwise.configs", "shardwise.deepspeed_engine",
                                "shardwise.trainer")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.endswith(("detect", "given_or_detected")):
                    found.append(f"{name}: {ast.unparse(node)[:60]}")
                if called.endswith("read_training_args") and any(
                        k.arg == "trainer" for k in node.keywords):
                    found.append(f"{name}: {ast.unparse(node)[:60]}")
                if called.endswith(".replace") and "str(exc)" in ast.unparse(node):
                    found.append(f"{name}: {ast.unparse(node)[:60]}")
            if isinstance(node, ast.arg) and node.arg == "trainer" and \
                    name.startswith("shardwise.configs"):  # a reading's flag, not a Trainer
                found.append(f"{name}: a 'trainer' argument")
    assert found == [], found


def test_mesh_sizes_are_worked_out_in_mesh_py_and_asked_by_name():
    """Transforms declare the dimensions they run on (``mesh_dims``); only ``mesh.py`` sizes
    them (``layout``, ``tp_size``), the layout is worked out only where a plan is built
    (``layout_of`` in ``transforms/base.py``: ``plan_for``, and a transform applied by hand)
    and every other part reads it from the plan; nothing recognises a transform by its name
    to do so."""
    found = []
    for path in SRC.rglob("*.py"):
        if module_name(path) == "shardwise.parallel.mesh":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("layout", "mesh.layout", "tp_size", "batch_copies") or \
                        name.endswith((".size_for", ".group_size")):
                    found.append(f"{module_name(path)}: {ast.unparse(node)[:60]}")
                if name.endswith("layout_of") and \
                        module_name(path) != "shardwise.transforms.base":
                    found.append(f"{module_name(path)}: {ast.unparse(node)[:60]}")
            if isinstance(node, ast.Compare) and "factory_name" in ast.unparse(node):
                found.append(f"{module_name(path)}: {ast.unparse(node)[:60]}")  # by name
    assert found == [], found
    from shardwise.parallel.mesh import layout_of

    layout = layout_of(sw.Env(world_size=8, local_world_size=4, num_nodes=2),
                               [sw.shard(replicate_across_nodes=True), sw.tensor_parallel(size=2)])
    assert layout.dims == (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    assert layout_of(sw.Env(world_size=4, local_world_size=4),
                             [sw.shard()]).dims == (("dp_shard", 4),)
    # cp sits inside the data dimensions, tp innermost: one cp x tp block reads one batch
    cp = layout_of(sw.Env(world_size=8, local_world_size=8),
                   [sw.shard(), sw.context_parallel(size=2)])
    assert cp.dims == (("dp_shard", 4), ("cp", 2))
    assert (cp.copies, cp.data_ranks(8), [cp.data_rank(r) for r in range(4)]) == (2, 4, [0, 0, 1, 1])
    from shardwise.errors import EnvError
    from shardwise.parallel.mesh import layout
    from shardwise.transforms.base import plan_for

    assert plan_for(sw.Env(world_size=8, local_world_size=8), [sw.context_parallel(size=4)]).copies == 4
    assert plan_for(sw.Env(), [sw.context_parallel(size=4)]).copies == 1  # one process
    assert layout(sw.Env(world_size=8, local_world_size=8), tp=2, cp=2).dims == (
        ("dp_shard", 2), ("cp", 2), ("tp", 2))
    with pytest.raises(EnvError, match="context_parallel\\(size=3\\)"):
        layout_of(sw.Env(world_size=4, local_world_size=4), [sw.context_parallel(size=3)])


def test_a_new_model_split_is_one_row_of_the_table(monkeypatch):
    """A dimension that splits the model is declared once (a row of ``SPLITS`` and a
    transform's ``mesh_dims``): its default size, its place, the block that reads one batch,
    each rank's data share and the divisibility message follow from the table."""
    from shardwise.errors import EnvError
    from shardwise.parallel import mesh

    class Declares:  # a transform of a new kind, as layout_of sees one
        def __init__(self, dims):
            self.dims = dims

        def mesh_dims(self):
            return self.dims

    monkeypatch.setattr(mesh, "SPLITS", (*mesh.SPLITS[:2], ("xp", "new_parallel"),
                                         mesh.SPLITS[2]))
    env = sw.Env(world_size=16, local_world_size=8)
    new = mesh.layout_of(env, [sw.shard(), sw.tensor_parallel(size=2), Declares({"xp": None})])
    # None: the ranks of a node the tp groups inside it leave (8 / 2)
    assert new.dims == (("dp_shard", 2), ("xp", 4), ("tp", 2))
    assert (new.copies, new.data_ranks(16), new.holders) == (8, 2, 2)
    assert mesh.data_share(attrs.evolve(env, rank=9), new) == (2, 1, 8)
    with pytest.raises(EnvError, match=r"new_parallel\(size=3\) x tensor_parallel\(size=2\) "
                       r"must divide the world size 16"):
        mesh.layout_of(env, [Declares({"xp": 3}), sw.tensor_parallel(size=2)])
    with pytest.raises(EnvError, match=r"tensor_parallel\(size=None: the 6 ranks of a node\) "
                       r"must divide the world size 8"):
        mesh.layout_of(sw.Env(world_size=8, local_world_size=6), [sw.tensor_parallel()])


def test_the_test_tiers_are_visible_in_the_layout():
    """tests/unit starts no process group or job, tests/distributed runs real ranks (gloo on
    CPU), tests/gpu is behind the ``gpu`` marker; no test module sits outside a tier."""
    import re

    tests = Path(__file__).resolve().parents[1]
    assert sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name[0] != "_"
                  and p.name != "__pycache__") == ["distributed", "gpu", "unit"]
    assert not list(tests.glob("test_*.py"))
    starts_ranks = re.compile(r"run_distributed\(|run_jobs\(|os\.fork\(|torch\.distributed\.run")
    assert [p.name for p in (tests / "unit").glob("test_*.py")
            if starts_ranks.search(p.read_text())] == []
    assert all(starts_ranks.search(p.read_text()) or "subprocess" in p.read_text()
               for p in (tests / "distributed").glob("test_*.py"))
    assert all("pytest.mark.gpu" in p.read_text() for p in (tests / "gpu").glob("test_*.py"))


def test_no_module_replaces_interpreter_hooks():
    """STYLE rule 8: shardwise changes no interpreter-wide hook (``sys.excepthook``); a rank
    that failed is told by ``sys.last_exc`` when the exit handlers run."""
    found = [f"{module_name(p)}: {ast.unparse(n)[:60]}" for p in SRC.rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Assign)
             and any(ast.unparse(t).startswith("sys.") for t in n.targets)]
    assert found == [], found
