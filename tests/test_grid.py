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
