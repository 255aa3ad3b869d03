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


def test_the_stop_request_rides_on_the_grad_norm_all_reduce(monkeypatch):
    """A stop request (SIGTERM, time limit) is carried by the step's grad-norm all-reduce: no
    extra all-reduce and host read per iteration. The norm's bits and the overflow flag are
    unchanged; another rank's request or overflow arrives through the sum."""
    import torch.distributed as dist

    from hybrid.job.preemption import StopSignal
    from hybrid.zero import grad_norm

    g = [torch.randn(100, generator=torch.Generator().manual_seed(0))]
    alone = grad_norm.global_grad_norm(g, [])
    reduces = []
    other = torch.zeros(2, dtype=torch.float64)  # what the other rank contributes

    def all_reduce(t, op=None, group=None):
        reduces.append(t.numel())
        if t.numel() == 2:
            t += other

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=True) == (*alone, True)
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=False) == (*alone, False)
    other[1] = grad_norm.STOP_UNIT  # the other rank got SIGTERM
    assert grad_norm.global_grad_norm_and_stop(g, [])[1:] == (False, True)
    other[1] = 1.0  # the other rank overflowed
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=True)[1:] == (True, True)
    assert grad_norm.global_grad_norm_and_stop(g, [])[1:] == (True, False)
    reduces.clear()
    stop = StopSignal(None, signals=())
    assert not stop.should_stop("cpu", reduced=False) and stop.should_stop("cpu", reduced=True)
    assert reduces == []  # the step's all-reduce already told every rank
    assert not stop.should_stop("cpu") and reduces == [1]  # no step this iteration (NaN loss)
    stop.received = 15
    assert stop.requested()
