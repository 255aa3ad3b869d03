"""Data-parallel collectives of the ZeRO engine, with a byte ledger.

"Bytes moved" per collective is what one rank sends under the ring algorithm, the volume the
ZeRO paper counts (arXiv 1910.02054 §7, with the (n-1)/n factor kept):

- ``all_reduce`` of N bytes: ``2 (n-1)/n N``;
- ``reduce_scatter`` of an N-byte input: ``(n-1)/n N``;
- ``all_gather`` into an N-byte output: ``(n-1)/n N``;

with n the group size (nothing is moved when n = 1). The ZeRO engine's data-parallel traffic is
recorded under these three names; the world-wide all-reduce of the grad norm and overflow flag
(16 bytes) under ``norm_all_reduce``, and state export / consolidation gathers under
``state_all_gather`` (not training traffic).

``skip_collectives`` (the benchmark's *compute-only floor*) counts the bytes as usual but moves
nothing: each rank only does local work (an all-reduce leaves ``t``, a reduce-scatter keeps the
rank's own chunk of its input, an all-gather writes the rank's own chunk into every slot, so
gathered parameters stay finite). The numbers are then wrong; only the time without
data-parallel communication is of interest.

``recorder`` (the benchmark's *collectives alone*): when a list, every collective appends
``(op, input elements, dtype)``; :func:`replay` issues the same collectives again with no compute
around them, so a step's time can be compared with its compute-only floor plus its collectives.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hybrid.parallel.ops import all_gather_flat, reduce_scatter_flat


class _Done:
    """Stands in for a work handle when nothing was communicated."""

    def wait(self):
        return True


class DPComm:
    """Collectives over one group that count their bytes (see the module docstring)."""

    skip_collectives = False
    """Compute-only floor: count but do not communicate (see the module docstring)."""
    recorder: list | None = None
    """When a list: ``(op, input elements, dtype)`` of every collective (see :func:`replay`)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes: dict[str, float] = defaultdict(float)

    def _count(self, op: str, t: torch.Tensor, factor: float = 1.0, kind: str | None = None):
        """One collective on input ``t``: its ring volume (``factor`` x (n-1)/n x ``t``'s bytes)
        into the ledger under ``kind`` (default ``op``) and, with a recorder, ``(op, elements, dtype)``."""
        if self.recorder is not None:
            self.recorder.append((op, t.numel(), t.dtype))
        if self.size > 1:
            self.bytes[kind or op] += factor * (self.size - 1) / self.size * t.numel() * t.element_size()

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        """Sum ``t`` in place over the group."""
        self._count("all_reduce", t, 2.0)
        if self.size == 1 or self.skip_collectives:
            return _Done()
        return dist.all_reduce(t, group=self.group, async_op=async_op) or _Done()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``out`` (n times smaller) = this rank's chunk of the sum of ``inp`` over the group."""
        self._count("reduce_scatter", inp)
        if self.size == 1 or self.skip_collectives:
            n = out.numel()
            out.copy_(inp[self.rank * n:(self.rank + 1) * n])
            return _Done()
        return reduce_scatter_flat(out, inp, self.group, async_op=async_op) or _Done()

    def all_gather(self, out, inp: torch.Tensor, async_op: bool = False, kind: str = "all_gather"):
        """``out``: one tensor of n x ``inp`` elements (rank-major) or a list of n tensors;
        ``kind`` names the ledger entry."""
        self._count("all_gather", inp, self.size, kind)
        if self.size == 1 or self.skip_collectives:  # the floor writes its chunk everywhere
            for o in (out if isinstance(out, list) else out.view(self.size, -1)):
                o.copy_(inp.view_as(o))
            return _Done()
        if isinstance(out, list):
            return dist.all_gather(out, inp, group=self.group, async_op=async_op) or _Done()
        return all_gather_flat(out, inp, self.group, async_op=async_op) or _Done()

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()


def replay(comm: DPComm, recorded: list, repeats: int = 3, device: str | torch.device = "cpu") -> list[float]:
    """Issue ``recorded`` (a :attr:`DPComm.recorder` list, identical on every rank of the group)
    again ``repeats`` times, each collective synchronous and flat (an all-gather into a list runs
    as one into a flat tensor), on zero-filled buffers (one per op, size and dtype, allocated
    before timing); returns the seconds of each repeat, between barriers.
    Collective over ``comm``'s group; nothing is counted in its byte ledger."""
    import time

    n = comm.size
    if n == 1:
        return [0.0] * repeats
    bufs = {}
    for op, numel, dtype in recorded:
        if (op, numel, dtype) not in bufs:
            out = numel * n if op == "all_gather" else numel // n if op == "reduce_scatter" else 0
            bufs[op, numel, dtype] = (torch.zeros(numel, dtype=dtype, device=device),
                                      torch.zeros(out, dtype=dtype, device=device))
    times = []
    for _ in range(repeats):
        dist.barrier(group=comm.group)
        t0 = time.perf_counter()
        for op, numel, dtype in recorded:
            inp, out = bufs[op, numel, dtype]
            if op == "all_reduce":
                dist.all_reduce(inp, group=comm.group)
            elif op == "reduce_scatter":
                reduce_scatter_flat(out, inp, comm.group)
            else:
                all_gather_flat(out, inp, comm.group)
        dist.barrier(group=comm.group)
        times.append(time.perf_counter() - t0)
    return times
