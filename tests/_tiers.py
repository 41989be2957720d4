# Test tiers by what a test starts: marks set at collection from each module's code, not its folder.
"""Which tests start processes, found by reading their module (``ast``), so the marker never
has to be remembered: a test is marked ``processes`` when it, a fixture it takes or a
function of its module it calls (however deep) calls one of :data:`STARTERS`; ``many_ranks``
when such a call asks for 4 or more ranks (``world_size=4``) or starts ``torchrun``.

``make test-fast`` runs ``-m "not processes"``: the single-process tests, in a couple of
minutes on 2 cores. Fixtures of ``conftest.py`` are read too; a helper imported from another
test module is not followed (``test_the_fast_tier_starts_no_process`` lists what the fast tier
runs against what the modules import, so such a test shows up there).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

#: calls that start processes (the last part of the called name)
STARTERS = frozenset({"run_distributed", "run_jobs", "Popen", "check_output", "check_call",
                      "Process", "spawn", "start_processes", "fork"})
#: ``subprocess.run(...)``, not every ``run``
QUALIFIED = frozenset({"subprocess.run"})
TORCHRUN = ("torch.distributed.run", "torchrun", "--nproc_per_node", "shardwise launch")


def _called(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _name(call: ast.Call) -> tuple[str, str]:
    full = ast.unparse(call.func)
    return full, full.rsplit(".", 1)[-1]


def _many(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "world_size" and isinstance(keyword.value, ast.Constant) and \
                isinstance(keyword.value.value, int) and keyword.value.value >= 4:
            return True
    return False


@functools.cache
def kinds(path: Path) -> dict[str, frozenset[str]]:
    """Each function of the module at ``path`` (tests, fixtures, helpers, by name): the marks
    its calls earn it, ``processes`` and ``many_ranks``."""
    tree = ast.parse(path.read_text())
    functions: dict[str, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(node.name, node)
    direct: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    for name, node in functions.items():
        marks: set[str] = set()
        called: set[str] = set()
        torchrun = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and
                       any(mark in n.value for mark in TORCHRUN) for n in ast.walk(node))
        for call in _called(node):
            full, last = _name(call)
            if last in STARTERS or full in QUALIFIED:
                marks.add("processes")
                if _many(call) or torchrun:
                    marks.add("many_ranks")
            called.add(last)
        direct[name], calls[name] = marks, called & set(functions)
    done: dict[str, frozenset[str]] = {}

    def resolve(name: str, seen: frozenset[str]) -> frozenset[str]:
        if name in done:
            return done[name]
        marks = set(direct[name])
        for other in calls[name] - seen - {name}:
            marks |= resolve(other, seen | {name})
        if not seen:
            done[name] = frozenset(marks)
        return frozenset(marks)

    return {name: resolve(name, frozenset()) for name in functions}


def marks_of(path: Path, function: str, fixtures: list[str]) -> frozenset[str]:
    """The marks of test ``function`` of the module at ``path`` taking ``fixtures`` (its own
    module's or ``tests/conftest.py``'s)."""
    found = kinds(path)
    shared = kinds(Path(__file__).with_name("conftest.py"))
    marks = set(found.get(function, ()))
    for fixture in fixtures:
        marks |= found.get(fixture, shared.get(fixture, frozenset()))
    return frozenset(marks)
