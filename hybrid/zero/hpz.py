"""hpZ: a secondary partition of the ZeRO-3 parameters inside the node (ZeRO++, arXiv 2306.10209
§3.2; DeepSpeed's ``zero_hpz_partition_size``).

The primary partition stays as in ZeRO-3 (:mod:`hybrid.zero.stage3`): unit ``u``'s padded flat
buffer of ``P`` elements is cut into ``dp`` shards, and the forward gathers it from all of them,
across nodes. Once a forward gather is complete, each rank also keeps its part of a *secondary*
partition over its intra-node group of ``N`` data-parallel ranks (:mod:`hybrid.zero.topology`):
at intra-node position ``j``, the elements ``[j P / N, (j + 1) P / N)`` of the gathered buffer.
A backward gather of ``u`` then all-gathers those ``N`` parts inside the node, so the only
parameter gather that crosses nodes is the forward's: ZeRO-3's inter-node parameter traffic per
step goes from 2 Psi to Psi, at the cost of ``P / N`` more elements held per unit.

Exact: the secondary part is a copy of what the forward gathered (the compute-dtype values, or
the decoded ones under qwZ), so the backward sees the same parameters as under ZeRO-3, bit for
bit. The secondary copy is derived, never saved: it is marked stale at the start of every
forward (``invalidate``), so an optimizer step, a checkpoint load or new weights cannot leave a
stale copy behind, and it is refilled by the forward's gathers. A unit without a current copy
(e.g. a backward reached without its forward) is gathered from the primary partition.
"""

from __future__ import annotations

import torch

from hybrid.zero.comm import DPComm
from hybrid.zero.layout import PartitionLayout


class SecondaryPartition:
    """This rank's secondary shards of the non-persistent units and the intra-node collectives.

    Args:
        layout: the partition layout over the full data-parallel group.
        comm: collectives over the intra-node group (``N`` ranks; shares the engine's ledger).
        managed: per unit, whether it is gathered and released (non-persistent).
        dtype, device: of the secondary buffer (the compute dtype).
        chunk: elements per rank per all-gather.

    Raises:
        ValueError: ``N`` does not divide a unit's padded size (it always does when ``N``
            divides ``dp``).
    """

    def __init__(self, layout: PartitionLayout, comm: DPComm, managed: list[bool],
                 dtype: torch.dtype, device: torch.device, chunk: int):
        self.comm, self.chunk, self.n = comm, max(1, chunk), comm.size
        self.offsets: list[int | None] = []
        total = 0
        for u in layout.units:
            if u.padded % self.n:
                raise ValueError(f"unit {u.name}: {u.padded} elements do not split over "
                                 f"{self.n} hpZ ranks")
            self.offsets.append(total if managed[u.index] else None)
            total += u.padded // self.n if managed[u.index] else 0
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        """Compute dtype ``[sum of P / N over the non-persistent units]``."""
        self.current = [False] * len(layout.units)
        self.sizes = [u.padded // self.n for u in layout.units]

    def invalidate(self) -> None:
        """Mark every secondary shard stale (a new forward starts)."""
        self.current = [False] * len(self.current)

    def _part(self, u: int) -> torch.Tensor:
        return self.buffer[self.offsets[u]:self.offsets[u] + self.sizes[u]]

    @torch.no_grad()
    def save(self, u: int, buf: torch.Tensor) -> None:
        """Keep this rank's part of unit ``u``'s gathered buffer ``buf`` (``[P]``)."""
        s, j = self.sizes[u], self.comm.rank
        self._part(u).copy_(buf[j * s:(j + 1) * s])
        self.current[u] = True

    def gather(self, u: int, buf: torch.Tensor) -> list:
        """Start the intra-node all-gather of unit ``u`` into ``buf`` (``[P]``); the works."""
        s, n, part = self.sizes[u], self.n, self._part(u)
        works = []
        for lo in range(0, s, self.chunk):
            hi = min(s, lo + self.chunk)
            out = buf if (lo, hi) == (0, s) else [buf[r * s + lo:r * s + hi] for r in range(n)]
            works.append(self.comm.all_gather(out, part[lo:hi], async_op=True))
        return works

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def secondary_partition(grid, layout: PartitionLayout, comm: DPComm,
                        config) -> SecondaryPartition | None:
    """hpZ's secondary partition for ``config.hpz_partition_size`` (a
    :class:`hybrid.zero.config.ZeroConfig`) ranks, sharing ``comm``'s ledger; None when the size
    is 1 (off). Collective over the world (creates the intra- and inter-node groups).

    Raises:
        ValueError: the size does not divide the data-parallel ranks per node
            (:meth:`hybrid.zero.topology.NodeTopology.check_intra_size`).
    """
    from hybrid.zero.topology import build_node_groups

    n = config.hpz_partition_size
    if n <= 1:
        return None
    groups = build_node_groups(grid, n)
    intra = DPComm(groups.intra_group, ledger=comm)
    managed = [not u.persistent for u in layout.units]
    return SecondaryPartition(layout, intra, managed, config.dtype, grid.device,
                              config.allgather_bucket_size // n)
