"""The tree (``hybrid``, ``models``, ``data``) imports cleanly, module by module, and its import
graph has no cycle and no edge that runs back up a floor (:data:`FLOORS`).

Every ``hybrid`` module is imported in one fresh interpreter (nothing the test session imported
first can hide a missing import). The graph is read from the source: an edge ``a -> b`` for every
``import`` of a module ``b`` of the tree in ``a``, at module level or inside a function (a deferred
import that closes a cycle is still a cycle, only a hidden one), and under ``if TYPE_CHECKING:`` too
(a type named across two modules that import each other is the same knot, drawn in annotations).
Importing ``hybrid.x.y`` also runs ``hybrid.x``'s ``__init__``, so that is an edge too. Tests and
scripts are outside the graph.

Import plan (``python tests/test_imports.py`` prints its counts)::

    python tests/test_imports.py   ->   modules N, edges E, cycles 0, edges back up 0
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("hybrid", "models", "data")
"""The tree whose import plan is checked."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("models", "data"),
    ("hybrid",),
    ("hybrid.planner",),
    ("hybrid.job",),
    ("hybrid.dryrun",),
    ("hybrid.pretrain", "hybrid.plan", "hybrid.consolidate", "hybrid.export_hf",
     "hybrid.generate", "hybrid.plot_metrics"),
)
"""The floors, bottom first; a module is on the floor of the longest prefix that names it.

0. ``models`` (plain PyTorch, never a rank) and ``data`` (datasets, tokenizers): they import
   nothing of ``hybrid``.
1. ``hybrid``'s lower floors: config, the model-flag resolver, the device table, FLOPs,
   ``parallel``, ``activation``, ``zero``, ``checkpoint``, ``hf``, the training loop and
   ``parallelize``.
2. ``hybrid.planner``: memory and time arithmetic over the lower floors.
3. ``hybrid.job``: a validated job (CLI, checks, checkpoints, launch) over the planner and the
   lower floors.
4. ``hybrid.dryrun``: builds a validated job on fake tensors and compares with the planner.
5. Entry points: the ``python -m`` modules, the only ones that start a dry run
   (``hybrid.pretrain`` dispatches to it, ``hybrid.plan`` gives the planner ``--verify``); the
   job (``hybrid.job.pretrain``) and the planner's command line (``hybrid.planner.cli``) stay on
   their own floors.

An edge may stay on its floor or go down, never up."""


def tree_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def hybrid_modules() -> dict[str, Path]:
    return {m: p for m, p in tree_modules().items() if m.split(".")[0] == "hybrid"}


def import_graph() -> dict[str, set[str]]:
    """``{module: {modules of the tree it imports}}`` (see the module docstring for what
    counts)."""
    modules = tree_modules()
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
            if t.split(".")[0] not in PACKAGES:
                continue
            target = resolve(t)
            while target:
                if target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
                target = target.rpartition(".")[0]
    return graph


def floor(module: str) -> int:
    """The index in :data:`FLOORS` of the longest prefix naming ``module``."""
    best, length = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    assert best >= 0, f"{module} is on no floor"
    return best


def edges_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every edge ``a -> b`` with b on a higher floor than a."""
    return [f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
            for a in sorted(graph) for b in sorted(graph[a]) if floor(b) > floor(a)]


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    found, seen = [], set()
    for m in sorted(graph):
        if m in seen:
            continue
        cycle = find_cycle({k: v for k, v in graph.items() if k not in seen} | {m: graph[m]})
        if cycle is None:
            seen.add(m)
            continue
        found.append(cycle)
        seen.update(cycle)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m] & graph.keys()):
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


def test_no_import_cycle_in_the_tree():
    graph = import_graph()
    assert len(graph) > 40
    assert "hybrid.zero.config" in graph["hybrid.config"]  # the graph does see imports
    assert "models.config" in graph["models.blocks"]  # and models/, type-only imports included
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_edge_runs_back_up_a_floor():
    graph = import_graph()
    assert {floor("models.gpt"), floor("data.split"), floor("hybrid.config"),
            floor("hybrid.planner.plan"), floor("hybrid.job.cli"), floor("hybrid.dryrun.dry_run"),
            floor("hybrid.pretrain")} == set(range(len(FLOORS)))
    assert (floor("hybrid.job.pretrain"), floor("hybrid.planner.cli")) == (3, 2)
    assert edges_back_up(graph) == []


def test_the_checks_find_what_they_look_for():
    graph = {"models.gpt": {"hybrid.config"}, "hybrid.config": set(),
             "hybrid.job.cli": {"hybrid.dryrun"}, "hybrid.dryrun": {"hybrid.job.cli"}}
    assert edges_back_up(graph) == [
        "hybrid.job.cli (floor 3) -> hybrid.dryrun (floor 4)",
        "models.gpt (floor 0) -> hybrid.config (floor 1)"]
    assert all_cycles(graph) == [["hybrid.dryrun", "hybrid.job.cli", "hybrid.dryrun"]]


LOWER_FLOORS = ("hybrid.zero", "hybrid.parallel", "hybrid.activation", "hybrid.checkpoint",
                "hybrid.training")
"""Packages and modules below the job wing: the job assembles them, they never reach up into it."""


def test_nothing_below_the_job_wing_imports_it():
    graph = import_graph()
    assert "hybrid.job.checkpointing" in graph["hybrid.job.run"]  # the graph sees the wing
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


if __name__ == "__main__":
    g = import_graph()
    print(f"modules {len(g)}, edges {sum(map(len, g.values()))}, cycles {len(all_cycles(g))}, "
          f"edges back up {len(edges_back_up(g))}")
    for line in [*(" -> ".join(c) for c in all_cycles(g)), *edges_back_up(g)]:
        print(" ", line)
