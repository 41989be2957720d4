# The docs hold: every public name documented, docs/api.md current, every python block runs.
import importlib
import os
import re
import sys
import traceback
from pathlib import Path

import attrs
import pytest
import torch
from torch.utils.data import DataLoader

import shardwise as sw

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
GENERATED = "api.md"  # its code blocks are signatures, not programs
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != GENERATED)]
CODE_PAGES = [p for p in PAGES if "```python" in p.read_text()]
FENCE = re.compile(r"^```python\s*$")
DIRECTIVE = re.compile(r"^<!--\s*docs-test:(.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip\s*\((.*\S.*)\)\s*$")


def api_reference():
    """tools/api_reference.py, imported (it imports its neighbour docstring_markdown)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module("api_reference")


def public_names():
    testing = importlib.import_module("shardwise.testing")
    return ([(name, getattr(sw, name)) for name in sw.__all__]
            + [(f"errors.{n}", getattr(sw.errors, n)) for n in sw.errors.__all__]
            + [(f"testing.{n}", getattr(testing, n)) for n in testing.__all__])


@pytest.mark.parametrize("name, obj", public_names(), ids=[n for n, _ in public_names()])
def test_every_public_name_has_a_docstring_and_a_heading_in_the_api_page(name, obj):
    if not isinstance(obj, (str, int, float, bool, type(None))):  # plain constants are exempt
        assert (obj.__doc__ or "").strip(), f"sw.{name} has no docstring"
    headings = re.findall(r"^### `([^`]+)`$", (ROOT / "docs" / GENERATED).read_text(), re.MULTILINE)
    assert name in headings, f"sw.{name} is not in docs/api.md; run {api_reference().REGENERATE}"


def test_the_api_page_is_what_the_docstrings_generate():
    tool = api_reference()
    current, wanted = tool.PAGE.read_text(), tool.render()
    assert current == wanted, (f"docs/api.md is out of date: run `{tool.REGENERATE}`\n"
                               + tool.differences(current, wanted))


def test_the_architecture_page_names_every_module_of_the_package():
    """docs/architecture.md is drawn from the tree: a module added, moved or renamed without
    the page saying where it belongs fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "src" / "shardwise"
    files = sorted(p for p in package.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(files) > 60
    unnamed = [str(p.relative_to(package)) for p in files
               if f"`{p.relative_to(package).as_posix()}`" not in text and f"`{p.name}`" not in text]
    assert unnamed == [], f"docs/architecture.md does not name {unnamed}"


def test_the_api_page_output_is_stable():
    tool = api_reference()
    text = tool.render()
    assert text == tool.render()
    assert not re.search(r"0x[0-9a-fA-F]{6,}", text), "a memory address would change every run"


@attrs.frozen
class Block:
    """A ```python block: the page, its first code line (1-based), the code, why it is skipped."""

    page: str
    line: int
    code: str
    skip: str | None


def blocks(path):
    """The page's python blocks, each with the ``<!-- docs-test: skip (reason) -->`` above it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        directive = DIRECTIVE.match(lines[i - 1]) if i else None
        skip = None
        if directive:
            reason = SKIP.match(directive.group(1))
            assert reason, (f"{path.name}:{i}: write `<!-- docs-test: skip (why) -->` "
                            f"(got {lines[i - 1]!r})")
            skip = reason.group(1)
        found.append(Block(path.name, i + 2, "\n".join(lines[i + 1:end]), skip))
        i = end + 1
    return found


def classifier_data(n, seed):
    """``n`` token sequences labelled by whether their first token is in the upper half."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, 8), generator=gen)
    return [{"input_ids": ids[i], "labels": (ids[i, 0] >= 32).long()} for i in range(n)]


def fixtures():
    """Fresh objects under the names the docs use; a block gets new ones, since a pipeline
    refuses an optimizer that already holds state (a previous block trained it)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16,
                                      num_labels=2, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config)  # model(**batch).loss, .logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(classifier_data(32, seed=0), batch_size=4, shuffle=True)
    val_loader = DataLoader(classifier_data(10, seed=1), batch_size=4)
    return dict(model=model, optimizer=optimizer, loader=loader, train_loader=loader, train_dl=loader,
                val_loader=val_loader, eval_dl=val_loader,
                scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))


def evaluate(bundle):
    """Accuracy over ``bundle.eval_loader``, as docs/training-loop.md writes it."""
    correct = seen = 0
    for batch in bundle.eval_loader:
        preds = bundle.predict(batch).logits.argmax(-1)
        preds, labels = sw.gather_for_metrics((preds, batch["labels"]), bundle.eval_loader)
        correct += int((preds == labels).sum())
        seen += len(labels)
    return {"accuracy": correct / seen}


def saved_causal_lm(directory):
    """A tiny Llama saved with ``save_pretrained``, for ``AutoModelForCausalLM.from_pretrained(path)``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return {"path": str(directory)}


#: what a page's blocks use beyond the prelude, built in the page's working directory
EXTRAS = {"sharding.md": lambda: saved_causal_lm(Path("llama"))}


def prelude(page):
    """The names the page's blocks take as given: ``sw``, ``torch``, a tiny model, its
    optimizer, loaders and scheduler, a bundle, ``epochs`` and ``evaluate``."""
    namespace = {"__name__": f"docs:{page}", "sw": sw, "torch": torch, "epochs": 2,
                 "evaluate": evaluate, **fixtures()}
    namespace["bundle"] = sw.pipeline(sw.detect())(namespace["model"], namespace["optimizer"],
                                                   namespace["loader"])
    namespace.update(EXTRAS.get(page, dict)())
    return namespace


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh working directory; the environment and Accelerate's singletons restored after."""
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(environ)
    if "accelerate.state" in sys.modules:
        sys.modules["accelerate.state"].AcceleratorState._reset_state(True)


@pytest.mark.parametrize("path", CODE_PAGES, ids=[p.name for p in CODE_PAGES])
def test_the_python_blocks_of_a_page_run_in_order(path, isolated):
    namespace = prelude(path.name)
    for block in blocks(path):
        if block.skip:
            continue
        namespace.update(fixtures())
        # padded so that tracebacks give the line numbers of the page itself
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        try:
            exec(code, namespace)
            failure = None
        except Exception:
            failure = traceback.format_exc()
        if failure:
            first = block.code.strip().splitlines()[0]
            pytest.fail(f"{block.page}:{block.line}: the block starting {first!r} failed:\n{failure}",
                        pytrace=False)


def test_a_skipped_block_must_say_why(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip (needs 2 GPUs) -->\n```python\nx = 1\n```\n"
                    "```python\ny = 2\n```\n")
    assert [(b.line, b.code, b.skip) for b in blocks(page)] == [(3, "x = 1", "needs 2 GPUs"),
                                                                 (6, "y = 2", None)]
    page.write_text("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="page.md:1: write"):
        blocks(page)
