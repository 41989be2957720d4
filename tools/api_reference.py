# Writes docs/api.md from the docstrings of shardwise's public names; --check says when it is stale.
"""Generate the API reference, ``docs/api.md``, from the docstrings of ``shardwise.__all__``,
``shardwise.errors`` and ``shardwise.testing``.

Usage:
    .venv/bin/python tools/api_reference.py           # write docs/api.md
    .venv/bin/python tools/api_reference.py --check   # exit 1, naming what differs, if stale
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
from docstring_markdown import annotation, markdown, signature, stable_repr, with_factories

import shardwise

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
REGENERATE = ".venv/bin/python tools/api_reference.py"

#: the page's sections; a public name in none of them goes to "Other", so nothing is lost
GROUPS: dict[str, tuple[str, ...]] = {
    "Environment": ("CONFIG_ENV_VAR", "Env", "__version__", "detect", "ensure_process_group",
                    "main_process_first"),
    "Pipeline & transforms": ("Bundle", "Pipeline", "Plan", "Transform", "accumulate_gradients",
                              "auto", "by_class", "by_size", "checkpoint_activations", "deepspeed",
                              "clip_gradients", "distribute_data", "mixed_precision", "offload",
                              "pipeline", "place", "policies", "replicate", "shard",
                              "shard_optimizer"),
    "Training loop": ("Logger", "StepOutput", "TensorBoardLogger", "TrainState", "fit"),
    "Checkpoints": ("export", "latest_checkpoint", "load", "save"),
    "Configs": ("from_config", "from_ddp_args", "from_training_args"),
    "Metrics & data": ("gather_for_metrics", "reduce", "to_device"),
    "Memory": ("MemoryEstimate", "estimate_memory", "init_on_meta"),
    "Errors": ("errors",),
    "Testing helpers": ("testing",),
}
OTHER = "Other"
#: constants whose value depends on the installation, described instead of shown
DESCRIBED = {"__version__": "The installed version of shardwise, from the package metadata."}


@attrs.frozen
class Entry:
    """One documented name: its heading (``detect``, ``errors.ArgumentError``), the path user
    code reaches it by (``sw.detect``), the object and the modules that may define it."""

    heading: str
    path: str
    obj: Any
    homes: tuple[ModuleType, ...]


def is_constant(obj: Any) -> bool:
    """Neither a module, a class nor a function: a value (``__version__``, a type alias)."""
    return not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj))


def _sort_key(entry: Entry) -> tuple[str, str]:
    return entry.heading.lstrip("_").lower(), entry.heading


def _module_entries(prefix: str, module: ModuleType, top: set[int]) -> list[Entry]:
    """The names in ``module.__all__`` that are not documented at the top level already."""
    return [Entry(f"{prefix}.{name}", f"sw.{prefix}.{name}", getattr(module, name), (module,))
            for name in getattr(module, "__all__", ()) if id(getattr(module, name)) not in top]


@functools.cache
def _origins() -> dict[str, str]:
    """Each name ``shardwise/__init__.py`` imports (for type checkers, under
    ``if TYPE_CHECKING:``), with the module it comes from."""
    tree = ast.parse(inspect.getsource(shardwise))
    return {alias.asname or alias.name: node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}


def _homes(name: str) -> tuple[ModuleType, ...]:
    """Where a top-level name's ``#:`` comment may be: its module, then the package."""
    origin = _origins().get(name)
    return (*([importlib.import_module(origin)] if origin else []), shardwise)


def entries() -> dict[str, list[Entry]]:
    """Every documented name, by section, sorted within each."""
    top = {id(getattr(shardwise, name)) for name in shardwise.__all__
           if not is_constant(getattr(shardwise, name))}
    public = {name: getattr(shardwise, name) for name in shardwise.__all__}
    public["testing"] = importlib.import_module("shardwise.testing")  # imported on first use
    where = {name: group for group, names in GROUPS.items() for name in names}
    groups: dict[str, list[Entry]] = {group: [] for group in [*GROUPS, OTHER]}
    for name, obj in public.items():
        found = groups[where.get(name, OTHER)]
        found.append(Entry(name, f"sw.{name}", obj, _homes(name)))
        if inspect.ismodule(obj):
            found += _module_entries(name, obj, top)
    return {group: sorted(found, key=_sort_key) for group, found in groups.items() if found}


def comment_doc(name: str, modules: Iterable[ModuleType]) -> str:
    """The ``#:`` comment lines just above ``name = ...`` in the first module that has them."""
    pattern = re.compile(rf"^((?:#:.*\n)+){re.escape(name)}\s*[:=]", re.MULTILINE)
    for module in modules:
        try:
            found = pattern.search(inspect.getsource(module))
        except (OSError, TypeError):
            continue
        if found:
            return " ".join(line[2:].strip() for line in found.group(1).splitlines())
    return ""


def _bases(cls: type) -> str:
    names = [b.__qualname__ if b.__module__ in ("builtins", "typing") or
             b.__module__.startswith("shardwise") else f"{b.__module__}.{b.__qualname__}"
             for b in cls.__bases__ if b is not object]
    return ", ".join(names)


def _by_bases(cls: type) -> bool:
    """Shown by its bases, not its constructor: an exception or a protocol."""
    return issubclass(cls, BaseException) or bool(getattr(cls, "_is_protocol", False))


def _class_line(entry: Entry) -> str:
    cls = entry.obj
    try:
        sig = None if _by_bases(cls) else with_factories(cls, inspect.signature(cls))
    except (TypeError, ValueError):
        sig = None
    if sig is None:
        return f"class {entry.path}({_bases(cls)})" if _bases(cls) else f"class {entry.path}"
    if entry.path.rsplit(".", 1)[-1] != cls.__name__:  # a factory that is the class (shard = Shard)
        return signature(entry.path, sig, returns=False) + f" -> {cls.__name__}"
    return signature(f"class {entry.path}", sig, returns=False)


def _where(obj: Any) -> str:
    if inspect.isclass(obj):
        bases = f"; bases: `{_bases(obj)}`" if _bases(obj) and not _by_bases(obj) else ""
        return f"Class `{obj.__qualname__}` in `{obj.__module__}`{bases}."
    return f"Function in `{obj.__module__}`."


def members(cls: type, documented: set[type]) -> Iterator[tuple[str, Any]]:
    """Public methods and properties of ``cls`` (its own and those of undocumented shardwise
    bases), except those a documented base such as ``Transform`` lists already."""
    fields = {a.name for a in attrs.fields(cls)} if attrs.has(cls) else set()
    listed = {name for base in cls.__mro__[1:] if base in documented for name in vars(base)}
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("shardwise") and (klass is cls or klass not in documented):
            names |= {n for n in vars(klass) if not n.startswith("_") or n == "__call__"}
    for name in sorted(names - fields - listed):
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (property, functools.cached_property, classmethod, staticmethod)) \
                or inspect.isfunction(raw):
            yield name, raw


def _member_doc(cls: type, name: str) -> str | None:
    """The member's own docstring, else that of the same member in a shardwise base."""
    for klass in cls.__mro__:
        raw = vars(klass).get(name)
        raw = getattr(raw, "fget", None) or getattr(raw, "func", None) or raw
        if raw is not None and klass.__module__.startswith("shardwise") and raw.__doc__:
            return str(raw.__doc__)
    return None


def render_member(cls: type, name: str, raw: Any) -> list[str]:
    """A method or property under its class: ``#### `Class.name```, signature, docstring."""
    label = f"{cls.__name__}.{name}"
    if isinstance(raw, (property, functools.cached_property)):
        getter = raw.fget if isinstance(raw, property) else raw.func
        returns = inspect.signature(getter).return_annotation if getter else inspect.Signature.empty
        code = label if returns is inspect.Signature.empty else f"{label}: {annotation(returns)}"
    else:
        sig = inspect.signature(getattr(cls, name) if isinstance(raw, classmethod) else raw)
        if not isinstance(raw, (classmethod, staticmethod)):  # drop self
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        code = signature(label, sig)
    doc = markdown(_member_doc(cls, name))
    return [f"#### `{label}`", "", "```python", code, "```", "", *([doc, ""] if doc else [])]


def render_entry(entry: Entry, documented: set[type]) -> list[str]:
    """One name: heading, signature (or value), where it is defined, docstring, members."""
    obj = entry.obj
    out = [f"### `{entry.heading}`", ""]
    if inspect.ismodule(obj):
        names = ", ".join(f"`{n}`" for n in getattr(obj, "__all__", ()))
        out += [f"Module `{obj.__name__}`" + (f"; its public names: {names}." if names else "."), ""]
        doc = markdown(obj.__doc__)
    elif is_constant(obj):
        value = f": {type(obj).__name__}" if entry.heading in DESCRIBED else f" = {stable_repr(obj)}"
        out += ["```python", f"{entry.path}{value}", "```", ""]
        doc = DESCRIBED.get(entry.heading) or markdown(comment_doc(entry.heading.split(".")[-1],
                                                                   entry.homes))
    else:
        code = _class_line(entry) if inspect.isclass(obj) else signature(
            entry.path, inspect.signature(obj))
        out += ["```python", code, "```", "", _where(obj), ""]
        doc = markdown(obj.__doc__)
    out += [doc, ""] if doc else []
    if inspect.isclass(obj):
        for name, raw in members(obj, documented):
            out += render_member(obj, name, raw)
    return out


def slugger() -> Callable[[str], str]:
    """GitHub's heading anchors: lower case, punctuation dropped, repeats numbered."""
    seen: dict[str, int] = {}

    def slug(heading: str) -> str:
        base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(base, 0)
        seen[base] = count + 1
        return f"{base}-{count}" if count else base

    return slug


def render() -> str:
    """The whole page, as ``docs/api.md`` should hold it."""
    groups = entries()
    documented = {e.obj for found in groups.values() for e in found if inspect.isclass(e.obj)}
    slug = slugger()
    anchors: dict[str, str] = {}
    for group, found in groups.items():  # in page order, as GitHub numbers repeated anchors
        anchors[group] = slug(group)
        anchors.update((e.heading, slug(f"`{e.heading}`")) for e in found)
    lines = [
        "# API reference", "",
        "<!-- Generated from the docstrings by tools/api_reference.py: do not edit by hand. -->",
        "Generated from the docstrings (`tests/unit/test_docs.py` fails while it is out of date);",
        f"after changing one, regenerate it with `{REGENERATE}`.",
        "Names are reached as `sw.<name>` after `import shardwise as sw`; `sw.testing` is",
        "imported on first use.", "",
    ]
    lines += [f"- [{group}](#{anchors[group]}): " + ", ".join(
        f"[`{e.heading}`](#{anchors[e.heading]})" for e in found) for group, found in groups.items()]
    for group, found in groups.items():
        lines += [*([""] if lines[-1] else []), f"## {group}", ""]
        for e in found:
            lines += render_entry(e, documented)
    return "\n".join(lines).rstrip("\n") + "\n"


def sections(text: str) -> dict[str, str]:
    """The page split at its ``### `` headings, by heading."""
    parts = re.split(r"^### `([^`]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def differences(current: str, wanted: str) -> str:
    """What differs between the page on disk and the generated one, by name, with a diff."""
    old, new = sections(current), sections(wanted)
    named = [f"{what}: {', '.join(names)}" for what, names in (
        ("changed", [n for n in new if n in old and old[n] != new[n]]),
        ("missing from the page", [n for n in new if n not in old]),
        ("no longer public", [n for n in old if n not in new])) if names]
    diff = list(difflib.unified_diff(current.splitlines(), wanted.splitlines(), "docs/api.md",
                                     "generated", lineterm="", n=1))
    shown = diff[:60] + ([f"... ({len(diff) - 60} more diff lines)"] if len(diff) > 60 else [])
    return "\n".join([*(named or ["the text around the entries"]), *shown])


def main(argv: list[str] | None = None) -> int:
    """Write the page, or with ``--check`` return 1 (saying what differs) when it is stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; fail if out of date")
    args = parser.parse_args(argv)
    wanted = render()
    current = PAGE.read_text() if PAGE.exists() else ""
    if not args.check:
        PAGE.write_text(wanted)
        print(f"wrote {PAGE.relative_to(ROOT)}")
        return 0
    if current == wanted:
        return 0
    print(f"docs/api.md is out of date; run `{REGENERATE}`.\n{differences(current, wanted)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
