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

On gloo two collectives are composed from faster ones (measured on 4 CPU ranks, torch 2.13,
gloo 32 MiB fp32, median ms: ``reduce_scatter_tensor`` 156, ``all_reduce`` 102,
``all_to_all_single`` + a local sum 48; ``all_gather_into_tensor`` 98, one ``broadcast`` per rank
39): a reduce-scatter is an all-to-all of the input's chunks followed by the sum of the n
received chunks, in rank order, into ``out``; an all-gather of at least
:attr:`DPComm.broadcast_min_numel` output elements is n broadcasts, one from each rank's chunk.
Each rank sends the same (n-1)/n N bytes as in the ring, so the ledger is unchanged. NCCL (and
the dry run's fake backend) keep their native collectives, except one: an all-gather into a
*list* of slots (ZeRO-3's chunked gathers of a unit and the chunked parameter refresh, whose
slots are strided pieces of the rank-major unit buffer) runs on NCCL as one broadcast per rank
straight into its slot. NCCL's list all-gather would gather into a temporary flat buffer and copy
each rank's piece out of it (:attr:`DPComm.list_gather_by_broadcast`).
``DPComm.compose_on_gloo = False`` (before the engine is built) or ``engine.comm.composed =
False`` turns the gloo compositions off.

Intra-node and inter-node bytes (ZeRO++, arXiv 2306.10209 §2, counts the volume of each
collective over the slow cross-node links): every collective is also recorded in
``node_bytes["inter_node"]`` when its group spans more than one node
(:mod:`hybrid.zero.topology`: nodes of ``LOCAL_WORLD_SIZE`` ranks, ``HYBRID_LOCAL_WORLD_SIZE``
overriding it), else in ``node_bytes["intra_node"]``, under the same kind and with the same ring
volume. A ring over a group that spans nodes pushes its traffic through the slowest link, so the
whole volume counts as inter-node (the paper's convention). Several ``DPComm`` over different
groups (hpZ's intra-node group) may share one ledger (``ledger=``). qgZ's reduce-scatter
(:attr:`DPComm.quantized`) is counted as what its two all-to-alls send: the intra-node one as
intra-node bytes, the inter-node one as inter-node bytes (:mod:`hybrid.zero.qgz`).

``recorder`` (the benchmark's *collectives alone*): when a list, every collective appends
``(op, input elements, dtype)``; :func:`replay` issues the same collectives again with no compute
around them, so a step's time can be compared with its compute-only floor plus its collectives.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hybrid.parallel.ops import all_gather_flat, reduce_scatter_flat


class Work:
    """Work handle of a collective that ran synchronously or was skipped (no parts), or of a
    composed one (also qgZ's and qwZ's, :mod:`hybrid.zero.qgz`, :mod:`hybrid.zero.qwz`): ``wait``
    waits for its parts, then runs ``finish`` once."""

    def __init__(self, works=(), finish=None):
        self.works, self.finish = list(works), finish

    def wait(self):
        for w in self.works:
            w.wait()
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True



class DPComm:
    """Collectives over one group that count their bytes (see the module docstring).

    Args:
        group: the process group (None: the world).
        ledger: another ``DPComm`` whose byte ledger this one adds to (hpZ's intra-node group).
        quantized: qgZ's reduce-scatter over ``group`` (:attr:`quantized`), or None.
    """

    skip_collectives = False
    """Compute-only floor: count but do not communicate (see the module docstring)."""
    compose_on_gloo = True
    """Compose gloo's reduce-scatter and large all-gathers (see the module docstring)."""
    broadcast_min_numel = 1 << 18
    """Smallest all-gather output (elements) that gloo gathers by broadcasts: below it the n
    collectives' latency outweighs what they save (4 ranks: 4.7 vs 4.1 ms at 65,536 elements,
    3.7 vs 4.3 ms at 262,144)."""
    recorder: list | None = None
    """When a list: ``(op, input elements, dtype)`` of every collective (see :func:`replay`)."""
    list_gather_by_broadcast: bool
    """All-gathers into a list of slots run as one broadcast per rank into its slot (NCCL: no
    temporary flat buffer and no copies; see the module docstring)."""

    def __init__(self, group, ledger: DPComm | None = None, quantized=None):
        self.group = group
        self.quantized = quantized
        """ZeRO++ qgZ (``--zero-quantized-gradients``): a
        :class:`hybrid.zero.qgz.QuantizedReduceScatter` over ``group`` that every
        :meth:`reduce_scatter` runs instead, its intra- and inter-node bytes counted separately
        (given at construction, :func:`hybrid.zero.qgz.quantized_reduce_scatter`); None: exact
        collectives."""
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes: dict[str, float] = defaultdict(float) if ledger is None else ledger.bytes
        self.node_bytes: dict[str, dict[str, float]] = (
            {"intra_node": defaultdict(float), "inter_node": defaultdict(float)}
            if ledger is None else ledger.node_bytes)
        """Per locality, bytes per kind (see the module docstring); shared with ``ledger``."""
        self.composed = self.compose_on_gloo and self.size > 1 and dist.get_backend(group) == "gloo"
        """Compose reduce-scatter and large all-gathers from faster gloo collectives."""
        self.global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.list_gather_by_broadcast = self.size > 1 and dist.get_backend(group) == "nccl"
        self.inter_node = spans_nodes(self.global_ranks)
        """Whether this group spans more than one node (its bytes count as inter-node)."""

    def _count(self, op: str, t: torch.Tensor, factor: float = 1.0, kind: str | None = None):
        """One collective on input ``t``: its ring volume (``factor`` x (n-1)/n x ``t``'s bytes)
        into the ledger under ``kind`` (default ``op``) and, with a recorder,
        ``(op, elements, dtype)``."""
        if self.recorder is not None:
            self.recorder.append((op, t.numel(), t.dtype))
        if self.size > 1:
            self.add(kind or op, factor * (self.size - 1) / self.size * t.numel()
                     * t.element_size(), self.inter_node)

    def add(self, kind: str, nbytes: float, inter_node: bool) -> None:
        """Record ``nbytes`` under ``kind``, and as intra- or inter-node bytes."""
        self.bytes[kind] += nbytes
        self.node_bytes["inter_node" if inter_node else "intra_node"][kind] += nbytes

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        """Sum ``t`` in place over the group."""
        self._count("all_reduce", t, 2.0)
        if self.size == 1 or self.skip_collectives:
            return Work()
        return dist.all_reduce(t, group=self.group, async_op=async_op) or Work()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                       scratch: torch.Tensor | None = None):
        """``out`` (n times smaller) = this rank's chunk of the sum of ``inp`` over the group.
        ``scratch``: at least ``inp``'s elements, receives the all-to-all of a composed
        reduce-scatter (see :attr:`needs_scratch`; allocated per call when not given)."""
        if self.quantized is not None and self.size > 1:
            return self._quantized_reduce_scatter(out, inp, async_op)
        self._count("reduce_scatter", inp)
        if self.size == 1 or self.skip_collectives:
            n = out.numel()
            out.copy_(inp[self.rank * n:(self.rank + 1) * n])
            return Work()
        return self._reduce_scatter(out, inp, async_op, scratch)

    def _quantized_reduce_scatter(self, out, inp, async_op):
        """qgZ, counted as what its two all-to-alls send (``quantized.wire_bytes``)."""
        if self.recorder is not None:
            self.recorder.append(("reduce_scatter", inp.numel(), inp.dtype))
        intra, inter = self.quantized.wire_bytes(inp.numel())
        self.add("reduce_scatter", intra, False)
        self.add("reduce_scatter", inter, True)
        if self.skip_collectives:
            n = out.numel()
            out.copy_(inp[self.rank * n:(self.rank + 1) * n])
            return Work()
        return self.quantized(out, inp, async_op)

    @property
    def needs_scratch(self) -> bool:
        """Whether :meth:`reduce_scatter` receives into a scratch buffer as large as its input."""
        return self.composed and not self.skip_collectives and self.quantized is None

    def _reduce_scatter(self, out, inp, async_op, scratch=None):
        if self.quantized is not None:
            return self.quantized(out, inp, async_op)
        if not self.composed:
            return reduce_scatter_flat(out, inp, self.group, async_op=async_op) or Work()
        recv = torch.empty_like(inp) if scratch is None else scratch[:inp.numel()]
        work = dist.all_to_all_single(recv, inp, group=self.group, async_op=True)
        done = Work([work], lambda: torch.sum(recv.view(self.size, -1), 0, out=out))
        if not async_op:
            done.wait()
        return done

    def all_gather(self, out, inp: torch.Tensor, async_op: bool = False, kind: str = "all_gather"):
        """``out``: one tensor of n x ``inp`` elements (rank-major) or a list of n tensors;
        ``kind`` names the ledger entry."""
        self._count("all_gather", inp, self.size, kind)
        if self.size == 1 or self.skip_collectives:  # the floor writes its chunk everywhere
            for o in (out if isinstance(out, list) else out.view(self.size, -1)):
                o.copy_(inp.view_as(o))
            return Work()
        return self._all_gather(out, inp, async_op)

    def _all_gather(self, out, inp, async_op):
        by_broadcast = isinstance(out, list) and self.list_gather_by_broadcast
        if by_broadcast or self.composed and inp.numel() * self.size >= self.broadcast_min_numel:
            slots = out if isinstance(out, list) else out.view(self.size, -1)
            works = [dist.broadcast(inp if r == self.rank else slots[r], self.global_ranks[r],
                                    group=self.group, async_op=True) for r in range(self.size)]
            own = slots[self.rank]
            if own.data_ptr() != inp.data_ptr():
                own.copy_(inp.view_as(own))
            done = Work(works)
            if not async_op:
                done.wait()
            return done
        if isinstance(out, list):
            return dist.all_gather(out, inp, group=self.group, async_op=async_op) or Work()
        return all_gather_flat(out, inp, self.group, async_op=async_op) or Work()

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)

    def node_snapshot(self) -> dict[str, dict[str, float]]:
        """``{"intra_node": {kind: bytes}, "inter_node": {kind: bytes}}`` since the last reset."""
        return {k: dict(v) for k, v in self.node_bytes.items()}

    def reset(self) -> None:
        self.bytes.clear()
        for v in self.node_bytes.values():
            v.clear()


def spans_nodes(global_ranks) -> bool:
    """Whether ``global_ranks`` live on more than one node (:mod:`hybrid.zero.topology`)."""
    from hybrid.zero.topology import local_world_size

    local = local_world_size(dist.get_world_size())
    return len({r // local for r in global_ranks}) > 1


def replay(comm: DPComm, recorded: list, repeats: int = 3,
           device: str | torch.device = "cpu") -> list[float]:
    """Issue ``recorded`` (a :attr:`DPComm.recorder` list, identical on every rank of the group)
    again ``repeats`` times, each collective synchronous, flat (an all-gather into a list runs as
    one into a flat tensor) and implemented as ``comm`` implements it, on zero-filled buffers (one
    per op, size and dtype, allocated before timing); returns the seconds of each repeat, between
    barriers.
    Collective over ``comm``'s group; nothing is counted in its byte ledger."""
    import time

    n = comm.size
    if n == 1:
        return [0.0] * repeats
    bufs = {}
    for op, numel, dtype in recorded:
        if (op, numel, dtype) not in bufs:
            out = numel * n if op == "all_gather" else numel // n if op == "reduce_scatter" else 0
            scratch = numel if op == "reduce_scatter" and comm.needs_scratch else 0
            bufs[op, numel, dtype] = tuple(torch.zeros(k, dtype=dtype, device=device)
                                           for k in (numel, out, scratch))
    times = []
    for _ in range(repeats):
        dist.barrier(group=comm.group)
        t0 = time.perf_counter()
        for op, numel, dtype in recorded:
            inp, out, scratch = bufs[op, numel, dtype]
            if op == "all_reduce":
                dist.all_reduce(inp, group=comm.group)
            elif op == "reduce_scatter":
                comm._reduce_scatter(out, inp, False, scratch)
            else:
                comm._all_gather(out, inp, False)
        dist.barrier(group=comm.group)
        times.append(time.perf_counter() - t0)
    return times
