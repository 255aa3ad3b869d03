"""The 2D process grid: tensor parallel (fastest, inside a node) x data parallel (across nodes).

Rank layout (as Megatron-LM, arXiv 2104.04473 §3: tensor parallel inside a node)::

    rank = tp_rank + tp * dp_rank

so the ``tp`` ranks of one tensor-parallel group are consecutive (one node, NVLink) and a
data-parallel group strides across nodes. The groups come from a ``DeviceMesh`` of shape
``(dp, tp)`` named ``("dp", "tp")``; one :class:`ProcessGrid` owns them all and is passed
explicitly (no module-level state).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class GridShape:
    """Sizes of the grid's axes; ``world = tp * dp``."""

    tp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of global ``rank``."""
        return rank // self.tp, rank % self.tp


def validate_grid(world_size: int, tp: int, local_world_size: int | None = None) -> GridShape:
    """Check a requested grid against the world before any collective runs.

    Args:
        world_size: number of processes in the job.
        tp: tensor-model-parallel size.
        local_world_size: processes per host (torchrun's ``LOCAL_WORLD_SIZE``); when given, a
            tensor-parallel group must fit inside one host.

    Returns:
        The :class:`GridShape` with ``dp = world_size // tp``.

    Raises:
        ValueError: a non-positive size, ``tp`` not dividing the world, or a TP group that
            would span two hosts; the message spells out the numbers.
    """
    for name, value in (("world size", world_size), ("tensor-model-parallel size", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % tp:
        raise ValueError(
            f"tensor-model-parallel size {tp} does not divide the world size {world_size}; "
            f"valid tensor-model-parallel sizes: "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    if local_world_size is not None and local_world_size % tp:
        raise ValueError(
            f"tensor-model-parallel size {tp} does not divide the {local_world_size} processes per "
            f"node, so a tensor-parallel group would span two nodes; use a tp that divides "
            f"{local_world_size}"
        )
    return GridShape(tp=tp, dp=world_size // tp)


def default_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.

    Once the default process group exists its backend decides: a gloo world is a CPU world
    (e.g. the tests' :func:`hybrid.parallel.spawn.spawn_world` on a GPU host), so its fp32
    arithmetic and byte counts are the CPU ones. A gloo job that wants CUDA tensors passes its
    device explicitly.
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda",
                            int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0, device: torch.device | None = None) -> None:
    """Initialise the default process group from the ``torchrun`` environment if not done yet.

    The backend follows the device: NCCL for CUDA, gloo for CPU. A single process without
    ``RANK`` / ``WORLD_SIZE`` in the environment gets a world of one.
    """
    if dist.is_initialized():
        return
    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from hybrid.parallel.spawn import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


class ProcessGrid:
    """Owns the tensor-parallel and data-parallel process groups of one job.

    Build it after the default process group exists (``torchrun`` + :func:`init_distributed`,
    or ``hybrid.parallel.spawn.spawn_world`` in tests)::

        grid = ProcessGrid(tp=2)          # dp = world // 2
        grid.tp_group, grid.dp_group      # torch.distributed ProcessGroups
        grid.tp_rank, grid.dp_rank

    Use :meth:`check` (no collectives) to validate the requested sizes before
    initialising anything.

    Raises:
        ValueError: see :func:`validate_grid`.
        RuntimeError: the default process group is not initialised.
    """

    def __init__(self, tp: int = 1, device: torch.device | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid needs an initialised default process group "
                               "(call hybrid.parallel.grid.init_distributed() first)")
        world = dist.get_world_size()
        local = os.environ.get("LOCAL_WORLD_SIZE")
        self.shape = validate_grid(world, tp, int(local) if local else None)
        self.rank = dist.get_rank()
        self.world_size = world
        self.device = device or default_device()
        self.backend = dist.get_backend()
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type, (self.shape.dp, self.shape.tp), mesh_dim_names=("dp", "tp"),
        )
        self.dp_rank, self.tp_rank = self.shape.coords(self.rank)
        assert self.mesh.get_local_rank("tp") == self.tp_rank
        assert self.mesh.get_local_rank("dp") == self.dp_rank
        self.tp_group = self.mesh.get_group("tp")
        self.dp_group = self.mesh.get_group("dp")
        self.world_group = dist.group.WORLD

    check = staticmethod(validate_grid)

    @property
    def tp_size(self) -> int:
        """Tensor-model-parallel size."""
        return self.shape.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel size."""
        return self.shape.dp

    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group, in tp-rank order."""
        base = self.rank - self.tp_rank
        return list(range(base, base + self.tp_size))

    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, in dp-rank order."""
        return [self.tp_rank + i * self.tp_size for i in range(self.dp_size)]

    def __repr__(self) -> str:
        return (f"ProcessGrid(rank={self.rank}, tp={self.tp_size}, dp={self.dp_size}, "
                f"tp_rank={self.tp_rank}, dp_rank={self.dp_rank}, backend={self.backend})")
