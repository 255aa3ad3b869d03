"""Quantized gradient reduce-scatter with a hierarchical all-to-all: ZeRO++'s qgZ (arXiv
2306.10209 §3.3, DeepSpeed's ``zero_quantized_gradients``).

The data-parallel group of ``n = N * L`` ranks spans ``N`` nodes of ``L`` ranks each; data-parallel
rank ``d = a * L + i`` is local rank ``i`` of node ``a`` (the grid's layout: consecutive
data-parallel ranks share a node, :mod:`hybrid.zero.topology`). The reduce-scatter input
``inp`` holds ``n`` chunks of ``c`` elements, rank-major (chunk ``d`` is what rank ``d`` keeps
the sum of: the engine's partition layout, unchanged). For rank ``(a, i)``:

1. *intra-node*: regroup ``inp`` as ``[L, N * c]`` (row ``j`` = the chunks of ranks ``(b, j)``
   for every node ``b``), quantize each row, all-to-all over the node's ``L`` ranks;
2. dequantize the ``L`` rows received and sum them in fp32 (in local-rank order): the node's
   partial sums ``[N, c]`` of the chunks of ranks ``(b, i)``;
3. *inter-node*: quantize each of the ``N`` rows again, all-to-all over the ``N`` ranks
   ``(b, i)`` (one per node);
4. dequantize the ``N`` rows received and sum them in fp32 (in node order) into ``out``.

A stage whose group has one rank is skipped (nothing moves, nothing is quantized), so one node
is one quantized all-to-all and ``L = 1`` is DeepSpeed's flat quantized reduce-scatter. Every
step is deterministic (fixed summation order, round-half-even), so a resumed run repeats a
continuous one bit for bit.

Error bound (per element of ``out``; ``x_r`` the element's term from rank ``r``, ``A_r`` the
largest ``|x|`` of rank ``r`` 's input, ``qmax`` = 7 for int4, 127 for int8): stage 1 rounds each
term by at most ``A_r / (2 qmax)``; each node's dequantized partial sum is bounded by
``sum_(r in node) A_r``, so stage 3 rounds it by at most half that over ``qmax``; in all

    |out - sum_r x_r| <= sum_r A_r / qmax      (<= n max_r A_r / qmax)

plus fp32 summation rounding (~1e-7 relative). With ``L = 1`` or ``N = 1`` (one quantization)
the bound halves. :mod:`hybrid.zero.quantize` describes the blockwise format (the bound holds
per block; ``A_r`` over the whole input is the simple, looser form).

Bytes each rank sends (the ledger's unit; ``P(m)`` = :func:`hybrid.zero.quantize.payload_bytes`):
intra-node ``(L - 1) P(N c)``, inter-node ``(N - 1) P(c)``. Against a 16-bit reduce-scatter whose
inter-node share is ``(n - L) c`` elements of 2 bytes, int4 (block 256) sends
``(N - 1) 0.516 c / ((N - 1) L 2 c) = 0.26 / L`` of the inter-node bytes.

Transient memory per bucket (not counted by the planner; the dry run measures it): the
regrouped input (a copy in the gradient dtype), fp32 work tensors of about two copies of the
input while quantizing, and the sent and received payloads (``bits / 8 + 4 / 256`` bytes per
element each).

On gloo (torch 2.13) ``all_to_all_single`` exists for CPU tensors of every dtype used here
(``uint8`` payloads), on sub-groups and asynchronously, so both stages are one native
all-to-all on gloo and on NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybrid.zero.comm import Work
from hybrid.zero.quantize import DEFAULT_BITS, dequantize, payload_bytes, quantize


@dataclass(frozen=True)
class HierarchicalGroups:
    """The two process groups of one rank's hierarchical all-to-all.

    Attributes:
        intra_group: the ``L`` data-parallel ranks of this rank's node, in data-parallel order.
        inter_group: the ``N`` data-parallel ranks with this rank's local index, one per node,
            in node order.
        local: ``L``; nodes: ``N`` (``n = N * L``, the data-parallel size).
    """

    intra_group: object
    inter_group: object
    local: int
    nodes: int


class QuantizedReduceScatter:
    """qgZ's reduce-scatter (see the module docstring).

    Args:
        groups: this rank's intra- and inter-node groups.
        bits: 4 or 8 (:data:`hybrid.zero.quantize.QUANT_BITS`).

    Raises:
        ValueError: ``bits`` is not a supported width.
    """

    def __init__(self, groups: HierarchicalGroups, bits: int = DEFAULT_BITS):
        payload_bytes(1, bits)  # validates bits
        self.groups, self.bits = groups, bits
        self.size = groups.local * groups.nodes

    def wire_bytes(self, numel: int) -> tuple[float, float]:
        """``(intra-node, inter-node)`` bytes this rank sends to reduce-scatter ``numel``
        input elements (``n`` chunks of ``numel / n``)."""
        L, N = self.groups.local, self.groups.nodes
        c = numel // self.size
        intra = (L - 1) * payload_bytes(N * c, self.bits) if L > 1 else 0
        inter = (N - 1) * payload_bytes(c, self.bits) if N > 1 else 0
        return float(intra), float(inter)

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``out`` (``[c]``, any float dtype) = this rank's chunk of the sum over the group of
        ``inp`` (``[n c]``, rank-major). Returns a work handle whose ``wait()`` finishes the
        reduction (the intra-node all-to-all is in flight until then when ``async_op``).

        Raises:
            ValueError: ``inp`` is not ``n`` times ``out``.
        """
        L, N, c = self.groups.local, self.groups.nodes, out.numel()
        if inp.numel() != self.size * c:
            raise ValueError(f"qgZ reduce-scatter: input of {inp.numel()} elements is not "
                             f"{self.size} x the output's {c}")
        rows = inp.view(N, L, c).transpose(0, 1).reshape(L, N * c)  # row j -> local rank j
        if L == 1:
            return self._inter(out, rows.float().view(N, c), Work())
        send = quantize(rows, self.bits)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.groups.intra_group, async_op=True)
        done = Work([work], lambda: self._inter(
            out, dequantize(recv, N * c, self.bits).sum(0).view(N, c), None))
        if not async_op:
            done.wait()
        return done

    def _inter(self, out: torch.Tensor, partial: torch.Tensor, work):
        """Stages 3-4: ``partial`` (fp32 ``[N, c]``, row ``b`` for the rank of node ``b``) summed
        over the nodes into ``out``."""
        N, c = self.groups.nodes, out.numel()
        if N == 1:
            out.copy_(partial.view(c))
            return work
        send = quantize(partial, self.bits)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.groups.inter_group)
        out.copy_(dequantize(recv, c, self.bits).sum(0))
        return work


def quantized_reduce_scatter(grid, config) -> QuantizedReduceScatter | None:
    """The engine's qgZ reduce-scatter over ``grid``'s data-parallel group, or None when
    ``config`` (a :class:`hybrid.zero.config.ZeroConfig`) leaves ``quantized_gradients`` off or
    the data-parallel group has one rank. Creates the intra- and inter-node groups
    (:func:`hybrid.zero.topology.build_node_groups`): collective over the world.

    Raises:
        ValueError: the node size does not fit the grid
            (:class:`hybrid.zero.topology.NodeTopology`).
    """
    if not config.quantized_gradients or grid.dp_size == 1:
        return None
    from hybrid.zero.topology import build_node_groups

    ng = build_node_groups(grid)
    groups = HierarchicalGroups(ng.intra_group, ng.inter_group, len(ng.intra_ranks),
                                len(ng.inter_ranks))
    return QuantizedReduceScatter(groups, config.quantized_gradients_bits)
