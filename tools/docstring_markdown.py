# Docstrings and signatures as Markdown, stable from run to run: the pieces of docs/api.md.
"""Turn Google-style docstrings and ``inspect`` signatures into Markdown text.

Example:
    >>> print(markdown("Run it.\\n\\nArgs:\\n    n: how many."))
    Run it.
    <BLANKLINE>
    **Args:**
    <BLANKLINE>
    - `n`: how many.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Any

import attrs

__all__ = ["markdown", "signature", "stable_repr"]

#: sections whose lines are ``name: text`` items, rendered as a list
ITEM_SECTIONS = ("Args", "Arguments", "Attributes", "Raises")
#: sections whose body is code, rendered as a fenced block
CODE_SECTIONS = ("Example", "Examples")
SECTION = re.compile(r"^(Args|Arguments|Attributes|Raises|Returns|Yields|Example|Examples|Note|Notes"
                     r"|Warning|Warnings|See Also):\s*$")
ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")
LITERAL = re.compile(r"``(.+?)``")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
WIDTH = 100  # a signature longer than this is written one parameter a line


class Shown:
    """A value whose ``repr`` is the given text (a default as a reader should see it)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def stable_repr(value: Any) -> str:
    """``repr(value)`` without memory addresses, so the page is the same on every run."""
    return ADDRESS.sub("", repr(value))


def inline(text: str) -> str:
    """reST inline markup as Markdown: ``:func:`x``` and double backquotes become `x`."""
    return LITERAL.sub(r"`\1`", ROLE.sub(r"`\1`", text))


def fence(lines: list[str]) -> list[str]:
    """``lines`` as a fenced block: ``pycon`` for a doctest, else ``python``."""
    language = "pycon" if lines and lines[0].lstrip().startswith(">>>") else "python"
    return [f"```{language}", *lines, "```"]


def _items(lines: list[str]) -> list[str]:
    """``name: text`` lines (continued on deeper-indented lines) as a Markdown list."""
    out: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if line[0].isspace() and out:
            out[-1] += " " + line.strip()
            continue
        name, colon, text = line.partition(": ")
        out.append(f"- `{name}`: {text}" if colon else f"- {line}")
    return [inline(item) for item in out]


def _section(title: str, body: list[str]) -> list[str]:
    body = textwrap.dedent("\n".join(body)).strip("\n").splitlines()
    if title in CODE_SECTIONS:
        rendered = fence(body)
    elif title in ITEM_SECTIONS:
        rendered = _items(body)
    else:
        rendered = [inline(line) for line in body]
    return [f"**{title}:**", "", *rendered, ""]


def _indented_block(lines: list[str], start: int) -> int:
    """Index just past the block of blank or indented lines that starts at ``start``."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end][0].isspace()):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def markdown(doc: str | None) -> str:
    """A docstring as Markdown: prose kept, Args/Raises/... as lists, examples fenced."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        title = SECTION.match(line)
        if title:
            end = _indented_block(lines, i + 1)
            out += _section(title.group(1), lines[i + 1:end])
            i = end
        elif line.strip().startswith(">>>") and line[0].isspace():  # a doctest inside prose
            end = _indented_block(lines, i)
            out += [*fence(textwrap.dedent("\n".join(lines[i:end])).splitlines()), ""]
            i = end
        else:
            out.append(inline(line))
            i += 1
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip("\n")


def annotation(value: Any) -> str:
    """An annotation as written (string annotations stay as the source spelled them)."""
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _parameter(p: inspect.Parameter) -> str:
    stars = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
    text = stars + p.name
    if p.annotation is not p.empty:
        text += f": {annotation(p.annotation)}"
    if p.default is not p.empty:
        text += (" = " if p.annotation is not p.empty else "=") + stable_repr(p.default)
    return text


def _parameters(sig: inspect.Signature) -> list[str]:
    """The parameters with the ``/`` and ``*`` markers where Python would need them."""
    out: list[str] = []
    kinds = [p.kind for p in sig.parameters.values()]
    for i, p in enumerate(sig.parameters.values()):
        if i and kinds[i - 1] is p.POSITIONAL_ONLY and p.kind is not p.POSITIONAL_ONLY:
            out.append("/")
        if p.kind is p.KEYWORD_ONLY and p.VAR_POSITIONAL not in kinds[:i] \
                and (not i or kinds[i - 1] is not p.KEYWORD_ONLY):
            out.append("*")
        out.append(_parameter(p))
    if kinds and kinds[-1] is inspect.Parameter.POSITIONAL_ONLY:
        out.append("/")
    return out


def with_factories(cls: type, sig: inspect.Signature) -> inspect.Signature:
    """An attrs class's constructor signature with ``Factory`` defaults shown as calls."""
    if not attrs.has(cls):
        return sig
    factories = {a.alias: getattr(a.default, "factory", None) for a in attrs.fields(cls)}
    shown = {name: Shown(f"{factory.__name__}()") for name, factory in factories.items()
             if callable(factory) and getattr(factory, "__name__", "<lambda>") != "<lambda>"}
    return sig.replace(parameters=[p.replace(default=shown[p.name]) if p.name in shown else p
                                   for p in sig.parameters.values()])


def signature(prefix: str, sig: inspect.Signature, *, returns: bool = True) -> str:
    """``prefix(parameters) -> return``, on one line when it fits, else one parameter a line."""
    params = _parameters(sig)
    tail = ""
    if returns and sig.return_annotation is not sig.empty:
        tail = f" -> {annotation(sig.return_annotation)}"
    line = f"{prefix}({', '.join(params)}){tail}"
    if len(line) <= WIDTH:
        return line
    return "\n".join([f"{prefix}(", *(f"    {p}," for p in params), f"){tail}"])
