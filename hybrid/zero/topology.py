"""Which data-parallel ranks share a node: the intra-node and inter-node data-parallel groups.

Nodes are blocks of ``local_world_size`` consecutive global ranks (torchrun's
``LOCAL_WORLD_SIZE``, the processes per host). On the 2D grid of
:mod:`hybrid.parallel.grid` (``rank = tp_rank + tp * dp_rank``, tensor parallel inside a node)
a node holds ``local_world_size // tp`` consecutive data-parallel ranks of every tensor-parallel
rank's data-parallel group. Example, 8 ranks, tp 2, 4 per node (2 nodes)::

    node 0: ranks 0 1 2 3 = (dp 0, tp 0) (dp 0, tp 1) (dp 1, tp 0) (dp 1, tp 1)
    node 1: ranks 4 5 6 7 = (dp 2, tp 0) (dp 2, tp 1) (dp 3, tp 0) (dp 3, tp 1)
    dp group of tp 0: [0, 2, 4, 6]  intra-node (size 2): [0, 2], [4, 6]  inter-node: [0, 4], [2, 6]

An *intra-node group of size n* (ZeRO++'s hpZ secondary partition, arXiv 2306.10209 §3.2) is n
consecutive data-parallel ranks inside one node (n divides the data-parallel ranks per node);
the matching *inter-node group* holds the ranks at the same position of every intra-node group
of the same data-parallel group (ZeRO++'s hierarchical collectives, §3.3).

Override for tests and single-host experiments: the environment variable
``HYBRID_LOCAL_WORLD_SIZE`` (:data:`NODE_SIZE_ENV`) replaces ``LOCAL_WORLD_SIZE`` for this
module, so 4 CPU ranks launched as one host can act as 2 "nodes" of 2
(``HYBRID_LOCAL_WORLD_SIZE=2 torchrun --nproc-per-node 4 ...``). Without either variable the
whole world is one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

NODE_SIZE_ENV = "HYBRID_LOCAL_WORLD_SIZE"
"""Environment variable overriding torchrun's ``LOCAL_WORLD_SIZE`` (processes per node)."""


def local_world_size(world_size: int) -> int:
    """Processes per node: ``$HYBRID_LOCAL_WORLD_SIZE``, else ``$LOCAL_WORLD_SIZE``, else
    ``world_size`` (one node); never more than ``world_size``.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    for name in (NODE_SIZE_ENV, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer (processes per "
                                 "node)")
            return min(int(value), world_size)
    return world_size


@dataclass(frozen=True)
class NodeTopology:
    """Nodes of ``local`` consecutive ranks over a ``tp x dp`` grid (no processes needed).

    Raises (from :meth:`__post_init__`):
        ValueError: ``local`` does not divide the world, or ``tp`` does not divide ``local``
            (a tensor-parallel group would span two nodes); the message gives the numbers.
    """

    world_size: int
    tp: int
    local: int

    def __post_init__(self) -> None:
        if self.world_size % self.local:
            raise ValueError(f"{self.local} processes per node do not divide the world size "
                             f"{self.world_size}; set {NODE_SIZE_ENV} (or LOCAL_WORLD_SIZE) to a "
                             "divisor of the world")
        if self.local % self.tp:
            raise ValueError(f"tensor-model-parallel size {self.tp} does not divide the "
                             f"{self.local} processes per node")

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.world_size // self.tp

    @property
    def nodes(self) -> int:
        return self.world_size // self.local

    @property
    def dp_per_node(self) -> int:
        """Data-parallel ranks of one data-parallel group inside one node (``local // tp``)."""
        return self.local // self.tp

    def node_of(self, rank: int) -> int:
        """Node index of global ``rank``."""
        return rank // self.local

    def spans_nodes(self, ranks) -> bool:
        """Whether the global ``ranks`` live on more than one node."""
        return len({self.node_of(r) for r in ranks}) > 1

    def check_intra_size(self, size: int, flag: str = "--zero-hpz-partition-size",
                         node_from: str = f"{NODE_SIZE_ENV}, else torchrun's LOCAL_WORLD_SIZE"
                         ) -> None:
        """Raise ``ValueError`` unless ``size`` divides the data-parallel ranks per node
        (``node_from``: where the processes per node came from, for the message)."""
        if size < 1 or self.dp_per_node % size:
            valid = [d for d in range(1, self.dp_per_node + 1) if self.dp_per_node % d == 0]
            raise ValueError(
                f"{flag} {size}: a node holds {self.dp_per_node} data-parallel "
                f"rank{'s' * (self.dp_per_node != 1)} ({self.local} "
                f"process{'es' * (self.local != 1)} per node / tp {self.tp}); valid sizes: {valid}"
                + (" (tp must be smaller than the processes per node)"
                   if self.dp_per_node == 1 else "")
                + f"; processes per node come from {node_from}")

    def intra_node_groups(self, size: int) -> list[list[int]]:
        """Every intra-node data-parallel group of ``size`` ranks (global ranks, dp order), for
        all tensor-parallel ranks: ``tp * dp / size`` lists (tp rank major, then position)."""
        self.check_intra_size(size)
        return [[t + self.tp * d for d in range(g * size, (g + 1) * size)]
                for t in range(self.tp) for g in range(self.dp // size)]

    def inter_node_groups(self, size: int) -> list[list[int]]:
        """Every inter-node data-parallel group matching :meth:`intra_node_groups` (``size``):
        the ranks at the same position ``j`` of each intra-node group of one data-parallel
        group, ``tp * size`` lists of ``dp / size`` ranks."""
        self.check_intra_size(size)
        return [[t + self.tp * (g * size + j) for g in range(self.dp // size)]
                for t in range(self.tp) for j in range(size)]

    def groups_of(self, rank: int, size: int) -> tuple[list[int], list[int]]:
        """``(intra-node group, inter-node group)`` of global ``rank`` (``size`` as above)."""
        intra = next(g for g in self.intra_node_groups(size) if rank in g)
        inter = next(g for g in self.inter_node_groups(size) if rank in g)
        return intra, inter


@dataclass
class NodeGroups:
    """This rank's intra-node and inter-node data-parallel process groups (see the module
    docstring); built by :func:`build_node_groups`."""

    topology: NodeTopology
    size: int
    intra_ranks: list[int]
    inter_ranks: list[int]
    intra_group: object
    inter_group: object


def build_node_groups(grid, size: int | None = None) -> NodeGroups:
    """Create the intra-node data-parallel groups of ``size`` ranks (default: every
    data-parallel rank of the node) and the matching inter-node groups. Collective over the
    world: every rank creates every group, in the same order.

    Args:
        grid: the :class:`hybrid.parallel.grid.ProcessGrid`.
        size: ranks per intra-node group (must divide ``local // tp``).

    Raises:
        ValueError: see :class:`NodeTopology` and :meth:`NodeTopology.check_intra_size`.
    """
    import torch.distributed as dist

    topo = NodeTopology(grid.world_size, grid.tp_size, local_world_size(grid.world_size))
    size = topo.dp_per_node if size is None else size
    mine = {}
    for kind, groups in (("intra", topo.intra_node_groups(size)),
                         ("inter", topo.inter_node_groups(size))):
        for ranks in groups:
            g = dist.new_group(ranks)
            if grid.rank in ranks:
                mine[kind] = (ranks, g)
    return NodeGroups(topo, size, mine["intra"][0], mine["inter"][0], mine["intra"][1],
                      mine["inter"][1])
