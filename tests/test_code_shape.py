"""One job per function: no function in ``hybrid/``, ``models/`` or ``data/`` is over 60 lines.

A function's length is its whole span, from the ``def`` line to its last line (signature,
docstring, comments, blank lines and nested functions included); nested functions and methods
are measured on their own too. Read from the source with ``ast``, nothing is imported.
``scripts/`` and ``tests/`` are not held to it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid", "models", "data")
MAX_LINES = 60


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """``(line, qualified name, lines)`` of every function and method in ``path``."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                out.append((child.lineno, name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_function_over_60_lines():
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name, n in function_lengths(path)
        if n > MAX_LINES
    ]
    assert not long, f"over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_the_measure(tmp_path):
    src = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    src.write_text(f"class C:\n    def f(self):\n{body.replace('    ', '        ')}\n\n"
                   f"def g():\n    def h():\n{body.replace('    ', '        ')}\n    return h\n")
    assert function_lengths(src) == [(2, "C.f", 4), (7, "g", 6), (8, "g.h", 4)]
