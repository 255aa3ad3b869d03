"""Collective matmul: the sequence-parallel all-gather and reduce-scatter of tensor parallelism
pipelined with their GEMMs, chunk by chunk (``--tp-comm-overlap``).

Under sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2) a column-parallel
layer all-gathers its ``[b, s/t, in]`` input before its GEMM ("g") and a row-parallel layer
reduce-scatters its GEMM's output ("g-bar"); both collectives wait on the compute stream.
Decomposing each into the ``t`` sequence chunks of the ring lets every chunk's transfer run
during another chunk's GEMM (Wang et al. 2023, "Overlap communication with dependent computation
via decomposition in large deep learning models", ASPLOS '23, doi:10.1145/3567955.3567959, §3;
Megatron-LM's ``--tp-comm-overlap``, torchtitan's async TP):

- :func:`gather_linear` (all-gather + GEMM): at step ``k`` rank ``r`` multiplies the chunk of
  rank ``r + k`` it holds while it sends that chunk to rank ``r - 1`` and receives rank
  ``r + k + 1``'s from rank ``r + 1``; the first GEMM is on its own chunk, so no transfer waits
  before compute starts.
- :func:`linear_scatter` (GEMM + reduce-scatter): at step ``k`` rank ``r`` multiplies the rows
  of chunk ``r - 1 - k``, adds the partial sum of that chunk received from rank ``r - 1`` and
  sends it on to rank ``r + 1`` while the next chunk's GEMM runs; after ``t`` steps it holds the
  full sum of its own chunk.

The backward passes: the column-parallel layer keeps the bulk overlap of
:func:`hybrid.parallel.linear.functions.sequence_parallel_linear` (re-gather of the input during the
input-gradient GEMM, the input gradient's reduce-scatter during the weight-gradient GEMM, as
Megatron-LM's ``tp_comm_bulk_wgrad`` / ``tp_comm_bulk_dgrad``); the row-parallel layer's
all-gather of the output gradient is pipelined with its input-gradient GEMM as in forward, and
the weight-gradient GEMM runs once on the gathered gradient.

The transfers are ``torch.distributed`` point-to-point ops (``isend``/``irecv``, batched on
NCCL): gloo runs them on CPU, so the CPU tests prove exactness; on a GPU NCCL runs them on its
own stream and ``wait`` only makes the compute stream wait. Each chunk's GEMM is the full GEMM's
rows, so outputs equal the plain path's up to the order of the reduce-scatter's sum (fp32:
~1e-7). The ledger counts the bytes of the collective each ring replaces (the same, ring
accounting, ``hybrid.parallel.ops.TPLedger``). Every chunk's GEMM and every cast is
:mod:`hybrid.parallel.linear.gemm`'s (:meth:`~hybrid.parallel.linear.gemm.CastPolicy.chunk_mm`,
``out=`` into the ring's output, and :meth:`~hybrid.parallel.linear.gemm.CastPolicy.chunk_linear`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.parallel.linear.functions import sequence_parallel_linear
from hybrid.parallel.linear.gemm import CastPolicy, cast_policy, linear
from hybrid.parallel.ops import SEQ_DIM, TPLedger, all_gather_flat, local_seq_len, tensor_bytes


class _Ring:
    """Rank ``r`` of a TP group of ``t`` and its ring neighbours' global ranks."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.nccl = dist.get_backend(group) == "nccl"

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, to_next: bool) -> list:
        """Start sending ``send`` to the next rank (``to_next``) or the previous one and
        receiving ``recv`` from the other; returns the works to wait on."""
        dst, src = (self.next, self.prev) if to_next else (self.prev, self.next)
        if self.nccl:  # one NCCL group: the pair cannot deadlock on ordering
            return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, self.group),
                                           dist.P2POp(dist.irecv, recv, src, self.group)])
        return [dist.isend(send, dst, group=self.group), dist.irecv(recv, src, group=self.group)]


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def ring_gather_gemm(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                     ring: _Ring, policy: CastPolicy,
                     gathered: torch.Tensor | None = None) -> torch.Tensor:
    """``[t, b, s/t, out]``: chunk ``c`` (rank ``c``'s rows) of ``all_gather(x) @ weight_t
    (+ bias)``, from this rank's ``x`` ``[b, s/t, in]`` and ``weight_t`` ``[in, out]`` (the
    weight transposed for the forward, the weight itself for an input gradient; see the module
    docstring), each chunk's GEMM :meth:`CastPolicy.chunk_mm`. ``gathered`` (``[t, b, s/t,
    in]``, optional) receives the chunks themselves, for a caller that needs them (the
    row-parallel backward's weight gradient)."""
    r, t = ring.rank, ring.size
    x = x.contiguous()
    n_out = weight_t.shape[1]
    out = x.new_empty((t, *x.shape[:-1], n_out))
    cur = x if gathered is None else gathered[r].copy_(x)
    for k in range(t):
        c = (r + k) % t
        works, nxt = [], None
        if k < t - 1:
            nxt = torch.empty_like(x) if gathered is None else gathered[(c + 1) % t]
            works = ring.exchange(cur, nxt, to_next=False)
        policy.chunk_mm(cur.reshape(-1, cur.shape[-1]), weight_t, bias, out[c].view(-1, n_out))
        _wait(works)
        cur = nxt
    return out


def ring_gemm_scatter(y: torch.Tensor, weight: torch.Tensor, ring: _Ring, token_wise: bool,
                      policy: CastPolicy) -> torch.Tensor:
    """This rank's ``[b, s/t, out]`` of the sum over the ring of ``y @ weight.T``, ``y``
    ``[b, s, in]`` (rank-major tokens with ``token_wise``; see the module docstring), each
    chunk's GEMM :meth:`CastPolicy.chunk_linear`."""
    r, t = ring.rank, ring.size
    per = local_seq_len(y, t)
    chunks = (y.contiguous().view(t, y.shape[0], per, *y.shape[2:]) if token_wise
              else y.split(per, dim=SEQ_DIM))
    acc, works, recv = None, [], None
    for k in range(t):
        c = (r - 1 - k) % t
        part = policy.chunk_linear(chunks[c], weight)
        if k > 0:
            _wait(works)
            part = recv + part  # the previous ranks' partial sum of chunk c, then this rank's
        if k < t - 1:
            recv = torch.empty_like(part)
            works = ring.exchange(part, recv, to_next=True)
        acc = part
    return acc


def _seq_view(buf: torch.Tensor, token_wise: bool) -> torch.Tensor:
    """``[t, b, s/t, ...]`` rank-major -> ``[b, s, ...]`` (a view with ``token_wise`` or ``b ==
    1``, else one reordering copy; ``hybrid.parallel.ops.gather_seq_start``)."""
    if token_wise:
        return buf.view(buf.shape[1], -1, *buf.shape[3:])
    return buf.movedim(0, SEQ_DIM).flatten(SEQ_DIM, SEQ_DIM + 1)


def ring_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                       ledger: TPLedger | None, token_wise: bool,
                       policy: CastPolicy) -> torch.Tensor:
    """``[b, s, out_local]``: the forward of :func:`gather_linear`, ``x`` (``[b, s/t, in]``,
    cast) gathered on the ring chunk by chunk, each chunk multiplied as it arrives (module
    docstring); the ledger counts the all-gather it replaces."""
    ring = _Ring(group)
    if ledger is not None:
        ledger.count("all_gather", ring.size * tensor_bytes(x), ring.size)
    return _seq_view(ring_gather_gemm(x, weight.t(), bias, ring, policy), token_wise)


class _LinearScatter(torch.autograd.Function):
    """``reduce_scatter_seq(F.linear(y, weight))`` with the reduce-scatter pipelined with the
    GEMM; backward gathers the output gradient pipelined with the input-gradient GEMM."""

    @staticmethod
    def forward(ctx, y, weight, group, ledger, token_wise):
        ring, policy = _Ring(group), cast_policy(y.device)
        ctx.group, ctx.ledger, ctx.token_wise, ctx.y_dtype = group, ledger, token_wise, y.dtype
        ctx.policy = policy
        y, weight = policy.cast_input(y), policy.cast_weight(weight)
        ctx.save_for_backward(y, weight)
        out = ring_gemm_scatter(y, weight, ring, token_wise, policy)
        if ledger is not None:
            ledger.count("reduce_scatter", ring.size * tensor_bytes(out), ring.size)
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        ring, policy = _Ring(ctx.group), ctx.policy
        grad = policy.cast_grad(grad, weight).contiguous()
        t = ring.size
        if ctx.ledger is not None:
            ctx.ledger.count("all_gather", t * tensor_bytes(grad), t)
        gathered = grad.new_empty((t, *grad.shape))
        grad_y = None
        if ctx.needs_input_grad[0]:  # the input gradient's GEMM, chunk by chunk on the ring
            grad_y = _seq_view(ring_gather_gemm(grad, weight, None, ring, policy,
                                                  gathered=gathered), ctx.token_wise)
            grad_y = grad_y.to(ctx.y_dtype)
        else:
            all_gather_flat(gathered.view(-1), grad.view(-1), ctx.group)
        g2 = _seq_view(gathered, ctx.token_wise).reshape(-1, grad.shape[-1])
        grad_w = policy.wgrad(g2, y.reshape(-1, y.shape[-1]), weight)
        return grad_y, grad_w, None, None, None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                  ledger: TPLedger | None = None, token_wise: bool = False) -> torch.Tensor:
    """:func:`hybrid.parallel.linear.functions.sequence_parallel_linear` (``[b, s/t, in]`` ->
    ``[b, s, out_local]``) with its all-gather pipelined with the GEMM (module docstring);
    ``token_wise`` as there. At one rank it is :func:`hybrid.parallel.linear.gemm.linear`."""
    if dist.get_world_size(group) == 1:
        return linear(x, weight, bias)
    return sequence_parallel_linear(x, weight, bias, group, ledger, token_wise,
                                    gather_gemm=ring_gather_linear)


def linear_scatter(y: torch.Tensor, weight: torch.Tensor, group, ledger: TPLedger | None = None,
                   token_wise: bool = False) -> torch.Tensor:
    """:func:`hybrid.parallel.linear.functions.linear_reduce_scatter` (``[b, s, in_local]`` ->
    ``[b, s/t, out]``) with the reduce-scatter pipelined with the GEMM (module docstring).

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    if dist.get_world_size(group) == 1:
        return linear(y, weight)
    return _LinearScatter.apply(y, weight, group, ledger, token_wise)
