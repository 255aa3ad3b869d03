"""The CUDA path's choices, checked on CPU (issue 25): which code path a CUDA device takes, how
many kernels or host reads it costs, and that the CPU path keeps its bits. Each test carries the
case that failed before its fix."""

from __future__ import annotations

import math

import pytest
import torch


def test_grad_norm_on_cuda_is_one_multi_tensor_launch(monkeypatch):
    """CUDA: one ``_foreach_norm`` over every gradient fragment instead of one ``vector_norm``
    per 1M-element chunk (~5,900 launches per step at 1.5B); CPU keeps the chunked path."""
    from hybrid.zero import grad_norm

    g = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3000, 77, 0, 5)]
    calls = {"foreach": 0, "vector_norm": 0}
    foreach, vector_norm = torch._foreach_norm, torch.linalg.vector_norm

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(torch, "_foreach_norm", count("foreach", foreach))
    monkeypatch.setattr(torch.linalg, "vector_norm", count("vector_norm", vector_norm))
    monkeypatch.setattr(grad_norm, "NORM_CHUNK_ELEMENTS", 1000)
    cpu = grad_norm._sum_of_squares(g, torch.device("cpu"))
    assert calls == {"foreach": 0, "vector_norm": 5}  # 3 chunks + 1 + 1
    # the tensors are CPU ones; the device says which path a CUDA rank takes
    cuda = grad_norm._sum_of_squares(g, torch.device("cuda"))
    assert calls == {"foreach": 1, "vector_norm": 5}
    assert cuda.item() == pytest.approx(cpu.item(), rel=1e-13)  # float64 sums, another order
    g[1][3] = float("inf")
    assert not math.isfinite(grad_norm._sum_of_squares(g, torch.device("cuda")).item())
    assert grad_norm._sum_of_squares([], torch.device("cpu")).item() == 0.0
