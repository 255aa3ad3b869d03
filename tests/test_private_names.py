"""No private name crosses a file inside the packages of :data:`PACKAGES`: a module there never
imports another module's ``_name`` (``from hybrid.zero.comm import _Work``) or reads it as an
attribute (``comm._Work`` after ``from hybrid.zero import comm``). A name another file needs is
public, with its docstring. Read from the source with ``ast``, nothing is imported.

``python tests/test_private_names.py [DIR ...]`` prints each crossing and the count (default:
:data:`PACKAGES`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ("hybrid", "models", "data")
PACKAGES = ("hybrid/zero", "hybrid/parallel")
"""The directories held to 0 (issue 42)."""


def tree_modules() -> dict[str, Path]:
    """``{dotted module name: path}`` of every module of :data:`TREE`."""
    out = {}
    for package in TREE:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(directory: str) -> list[str]:
    """``path:line: module._name`` for every private name that a module under ``directory``
    takes from another module of the tree."""
    modules = tree_modules()
    found = []
    for name, path in modules.items():
        if not path.relative_to(ROOT).as_posix().startswith(directory + "/"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        bound = {}  # local name -> the tree module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif node.module in modules and node.module != name and _private(a.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"{node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                bound.update({a.asname or a.name: a.name for a in node.names
                              if a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name)
                    and bound.get(node.value.id, name) != name):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                             f"{bound[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_file():
    assert {d: crossings(d) for d in PACKAGES} == {d: [] for d in PACKAGES}


def test_the_count_sees_both_forms(tmp_path, monkeypatch):
    pkg = tmp_path / "hybrid" / "zz"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("class _W:\n    pass\n")
    (pkg / "b.py").write_text("from hybrid.zz.a import _W\nfrom hybrid.zz import a\nx = a._W\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossings("hybrid/zz") == ["hybrid/zz/b.py:1: hybrid.zz.a._W",
                                      "hybrid/zz/b.py:3: hybrid.zz.a._W"]


if __name__ == "__main__":
    for d in sys.argv[1:] or PACKAGES:
        lines = crossings(d.rstrip("/"))
        print("\n".join(lines))
        print(f"{d}: {len(lines)} private names imported across files")
