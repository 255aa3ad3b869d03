"""The tensor-parallel linear's one room (issue 42 item 1): every GEMM of a TP linear and every
cast of its operands is :mod:`hybrid.parallel.linear.gemm`'s, no private name crosses a file of
``hybrid/parallel/``, and each linear picks its forward (bulk collective or ring) at
construction. The source checks read the code with ``ast``; the rest runs in-process at one
rank (``torch.distributed`` stood in for).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid.parallel.linear import collective_matmul, functions, gemm
from hybrid.parallel.linear.modules import ColumnParallelLinear, RowParallelLinear

ROOT = Path(__file__).resolve().parents[1]
PARALLEL = ROOT / "hybrid" / "parallel"
GEMM_CALLS = {"linear", "mm", "addmm", "addmm_", "matmul", "bmm", "baddbmm"}
"""Callee names that multiply (``F.linear``, ``torch.mm``, ``x.matmul``, ...)."""


def gemm_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a GEMM as an attribute (``F.linear(...)``, ``x.matmul(...)``);
    the module's own helpers (``linear(...)`` unqualified) are not GEMMs themselves."""
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in GEMM_CALLS]


def private_imports(root: Path, top: Path = ROOT) -> list[str]:
    """``from X import _name`` or ``X._name`` where ``X`` is another module under ``root`` (a
    package of the tree at ``top``)."""
    package = ".".join(root.relative_to(top).parts)
    modules = {".".join(p.relative_to(top).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and node.module != name:
                        out.append(f"{path.name}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name):
                out.append(f"{path.name}: {node.value.id}.{node.attr}")
    return out


def test_the_tp_linears_multiply_only_in_gemm_py():
    where = {str(p.relative_to(PARALLEL)): lines for p in sorted(PARALLEL.rglob("*.py"))
             if (lines := gemm_calls(p))}
    assert list(where) == ["linear/gemm.py"], where


def test_no_private_name_crosses_a_file_of_hybrid_parallel():
    assert private_imports(PARALLEL) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "hybrid" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def _x(): pass\n")
    (pkg / "b.py").write_text("from hybrid.parallel.a import _x\nfrom hybrid.parallel import a\n"
                              "a._x()\nimport torch\ntorch.mm(1, 2)\n")
    assert sorted(private_imports(pkg, tmp_path)) == ["b.py: a._x",
                                                      "b.py: from hybrid.parallel.a import _x"]
    assert gemm_calls(pkg / "b.py") == [5]


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)


def test_the_forward_is_picked_at_construction(one_rank):
    """The three column forms and the three row forms; the overlap is refused without sequence
    parallelism, and setting the attribute afterwards changes nothing."""
    for sp, ring, col, row in ((False, False, functions.column_parallel_linear,
                                functions.linear_all_reduce),
                               (True, False, functions.sequence_parallel_linear,
                                functions.linear_reduce_scatter),
                               (True, True, collective_matmul.gather_linear,
                                collective_matmul.linear_scatter)):
        c = ColumnParallelLinear(4, 6, None, sequence_parallel=sp, tp_comm_overlap=ring)
        r = RowParallelLinear(6, 4, None, sequence_parallel=sp, tp_comm_overlap=ring)
        assert (c._forward, r._forward) == (col, row)
        assert (c._pair is None) == ring
    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(ValueError, match="needs --sequence-parallel"):
            cls(4, 4, None, tp_comm_overlap=True)
    c = ColumnParallelLinear(4, 6, None, sequence_parallel=True)
    c.tp_comm_overlap = True
    assert c._forward is functions.sequence_parallel_linear


def test_cast_policy_is_autocast_by_hand():
    """Under CPU bf16 autocast a TP linear's GEMM gives ``F.linear``'s output and gradients bit
    for bit; without it, it is ``F.linear`` itself (same autograd node); on ``meta`` (no
    autocast there) the policy casts nothing."""
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(*s, generator=g) for s in ((2, 3, 8), (5, 8), (5,)))
    runs = []
    for fn in (gemm.linear, F.linear):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy = gemm.cast_policy(x.device)
            y = fn(x, w, b)
        y.float().square().sum().backward()
        runs.append([y, x.grad, w.grad, b.grad])
    assert policy == gemm.CastPolicy("cpu", torch.bfloat16) and not policy.as_they_come
    assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(*runs, strict=True))
    x = x0.clone().requires_grad_()
    assert type(gemm.linear(x, w0).grad_fn) is type(F.linear(x, w0).grad_fn)
    assert gemm.cast_policy(torch.device("meta")).as_they_come
