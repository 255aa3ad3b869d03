"""The ``hybrid`` package imports cleanly, module by module, and its import graph has no cycle.

Every module is imported in one fresh interpreter (nothing the test session imported first
can hide a missing import). The graph is read from the source: an edge ``a -> b`` for every
``import`` of a ``hybrid`` module ``b`` in ``a``, at module level or inside a function (a deferred
import that closes a cycle is still a cycle, only a hidden one), and under ``if TYPE_CHECKING:`` too
(a type named across two modules that import each other is the same knot, drawn in annotations).
Importing ``hybrid.x.y`` also runs ``hybrid.x``'s ``__init__``, so that is an edge too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def hybrid_modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "hybrid").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: {hybrid modules it imports}}`` (see the module docstring for what counts)."""
    modules = hybrid_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets += [f"{node.module}.{a.name}" for a in node.names]
        for t in targets:
            if t.split(".")[0] != "hybrid":
                continue
            target = resolve(t)
            while target and target != "hybrid":
                if target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
                target = target.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_inside_hybrid():
    graph = import_graph()
    assert len(graph) > 40
    assert "hybrid.zero.config" in graph["hybrid.config"]  # the graph does see imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


LOWER_FLOORS = ("hybrid.zero", "hybrid.parallel", "hybrid.activation", "hybrid.checkpoint",
                "hybrid.training")
"""Packages and modules below the job wing: the job assembles them, they never reach up into it."""


def test_nothing_below_the_job_wing_imports_it():
    graph = import_graph()
    assert "hybrid.job.checkpointing" in graph["hybrid.job.pretrain"]  # the graph sees the wing
    below = [m for m in graph if any(m == f or m.startswith(f + ".") for f in LOWER_FLOORS)]
    assert {"hybrid.zero.engine", "hybrid.parallel.grid", "hybrid.activation.apply",
            "hybrid.checkpoint.shards", "hybrid.training"} <= set(below)
    up = {m: sorted(t for t in graph[m] if t == "hybrid.job" or t.startswith("hybrid.job."))
          for m in below}
    assert {m: t for m, t in up.items() if t} == {}


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.timeout(120)
def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(hybrid_modules())
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         cwd=ROOT, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n
            for p in [*ROOT.glob("hybrid/**/*.py"), *ROOT.glob("tests/*.py"),
                                                   *ROOT.glob("models/*.py"),
                      *ROOT.glob("data/*.py")]
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
