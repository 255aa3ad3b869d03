"""Grid validation happens before any collective (no process group needed)."""

import pytest

from hybrid.parallel.grid import GridShape, ProcessGrid, validate_grid


def test_shape_and_coords():
    shape = validate_grid(8, tp=2)
    assert shape == GridShape(tp=2, dp=4)
    assert [shape.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_tp_not_dividing_world_is_named():
    with pytest.raises(ValueError,
                       match=r"tensor-model-parallel size 3 does not divide the world size 8; "
                             r"valid tensor-model-parallel sizes: \[1, 2, 4, 8\]"):
        validate_grid(8, tp=3)


def test_tp_group_across_hosts_is_rejected():
    with pytest.raises(ValueError, match=r"span two nodes"):
        validate_grid(16, tp=8, local_world_size=4)
    assert validate_grid(16, tp=4, local_world_size=8).dp == 4


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_nonpositive_sizes(bad):
    with pytest.raises(ValueError, match="positive integer"):
        validate_grid(4, tp=bad)


def test_grid_needs_process_group():
    with pytest.raises(RuntimeError, match="init_distributed"):
        ProcessGrid(tp=1)


def test_a_gloo_world_on_a_gpu_host_stays_on_cpu(monkeypatch):
    """The CPU tests' gloo worlds keep their CPU device (and fp32 byte counts) on a GPU host."""
    import torch
    import torch.distributed as dist

    from hybrid.parallel import grid as grid_module
    from hybrid.parallel.spawn import spawn_world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert grid_module.default_device() == torch.device("cuda", 3)  # torchrun, before init
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert grid_module.default_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert grid_module.default_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="nccl needs one GPU per rank: 2 ranks, 1 GPUs"):
        spawn_world(2, print, backend="nccl")
    with pytest.raises(ValueError, match="backend 'mpi'"):
        spawn_world(1, print, backend="mpi")
