"""Conjugate autograd collectives of tensor parallelism, with a byte ledger.

Megatron-LM paper (arXiv 1909.08053) §3, Figure 3, and its sequence-parallel form
(Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2, Figure 5):

- :func:`copy_to_tp` ("f"): identity forward, all-reduce of the gradient backward. Enters a
  column-parallel region.
- :func:`reduce_from_tp` ("f-bar"): all-reduce forward, identity backward. Leaves a row-parallel
  region.
- :func:`gather_sequence` ("g"): all-gather along the sequence dimension forward,
  reduce-scatter of the gradient backward. Enters a tensor-parallel region from a
  sequence-parallel one.
- :func:`reduce_scatter_sequence` ("g-bar"): reduce-scatter along the sequence forward,
  all-gather of the gradient backward. Leaves a tensor-parallel region into a sequence-parallel one.

All ops are no-ops when the group has one rank. Sequence ops split dimension 1 of ``[b, s, h]``
tensors into ``t`` contiguous chunks of ``s / t`` (rank r holds rows ``[r s/t, (r+1) s/t)``).

:class:`TPLedger` counts the bytes each collective moves per rank, in the ring accounting of
``hybrid.zero.comm`` (all-reduce of N bytes ``2 (t-1)/t N``, reduce-scatter of an N-byte input
or all-gather into an N-byte output ``(t-1)/t N``).

:func:`all_gather_flat` is the one flat all-gather (no autograd) that ZeRO's ledger, the
partitioned activation checkpoints and the sequence-parallel ops use. The launch-and-finish
forms (:func:`all_reduce_start`, :func:`gather_seq_start`, :func:`reduce_scatter_seq_start`) are
what the TP linears (:mod:`hybrid.parallel.linear`) overlap with their GEMMs.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

SEQ_DIM = 1
"""The sequence dimension of the model's ``[b, s, h]`` activations."""


class TPLedger:
    """Bytes moved per rank by tensor-parallel collectives, by kind (see the module docstring).

    Kinds: ``all_reduce``, ``all_gather``, ``reduce_scatter`` (the conjugate pairs of the
    activations), ``regather`` (sequence parallelism: the all-gather of a column-parallel
    layer's stored ``s/t`` input again in backward, for the weight gradient, 2205.05198 §4.2.2)
    and ``grad_all_reduce`` (sequence parallelism: gradients of replicated parameters computed
    from one sequence slice, summed over the TP group).
    """

    def __init__(self):
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def count(self, kind: str, nbytes: int, n: int) -> None:
        """Record one collective of ``kind`` over ``n`` ranks on ``nbytes`` (see module doc)."""
        if n > 1:
            factor = 2.0 if kind.endswith("all_reduce") else 1.0
            self.bytes[kind] += factor * (n - 1) / n * nbytes
            self.calls[kind] += 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def tensor_bytes(x: torch.Tensor) -> int:
    """Bytes of ``x``'s elements (what a collective on it moves, before the ring factor)."""
    return x.numel() * x.element_size()


def all_reduce_tp(x: torch.Tensor, group, ledger: TPLedger | None = None,
                  kind: str = "all_reduce") -> torch.Tensor:
    """The sum of ``x`` over ``group`` (no autograd), in place in ``x`` when it is contiguous;
    recorded as ``kind``. ``x`` itself at one rank."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if ledger is not None:
        ledger.count(kind, tensor_bytes(x), n)
    dist.all_reduce(x, group=group)
    return x


def all_reduce_start(x: torch.Tensor, group, ledger: TPLedger | None = None,
                     kind: str = "all_reduce"):
    """Launch the in-place sum of ``x`` (contiguous) over ``group``; its work handle, or None
    at one rank."""
    n = dist.get_world_size(group)
    if n == 1:
        return None
    if ledger is not None:
        ledger.count(kind, tensor_bytes(x), n)
    return dist.all_reduce(x, group=group, async_op=True)


def all_gather_seq(x: torch.Tensor, group, ledger: TPLedger | None = None,
                   kind: str = "all_gather", token_wise: bool = False) -> torch.Tensor:
    """``[b, s/t, ...]`` on each rank -> ``[b, s, ...]`` (rank-major along dim 1); no autograd.
    ``token_wise``: the ``b s`` tokens in the gather's own order (see :func:`gather_seq_start`)."""
    return gather_seq_start(x, group, ledger, kind, token_wise)()


def gather_seq_start(x: torch.Tensor, group, ledger: TPLedger | None, kind: str,
                     token_wise: bool = False):
    """Launch :func:`all_gather_seq` asynchronously; returns ``finish()`` -> ``[b, s, ...]``.

    The gather lands rank-major (``[t, b, s/t, ...]``); with ``b == 1`` the ``[b, s, ...]``
    result is a view of it, otherwise ``[b, s, ...]``'s layout needs one reordering copy.
    ``token_wise`` skips that copy: the result is the gather viewed as ``[b, s, ...]``, the
    right tokens in rank-major order, for a consumer that treats every token alike up to a
    ``token_wise`` reduce-scatter (the MLP between its column- and row-parallel linears).
    """
    n = dist.get_world_size(group)
    if n == 1:
        return lambda: x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if ledger is not None:
        ledger.count(kind, tensor_bytes(out), n)
    work = all_gather_flat(out, x, group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        if token_wise:
            return out.view(x.shape[0], -1, *x.shape[SEQ_DIM + 1:])
        return out.view(n, *x.shape).movedim(0, SEQ_DIM).flatten(SEQ_DIM, SEQ_DIM + 1)

    return finish


def local_seq_len(x: torch.Tensor, n: int) -> int:
    """``s / n`` for ``x`` of ``[b, s, ...]``; ValueError when ``n`` does not divide ``s``."""
    s = x.shape[SEQ_DIM]
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by the TP size {n}")
    return s // n


def reduce_scatter_seq(x: torch.Tensor, group, ledger: TPLedger | None = None,
                       token_wise: bool = False) -> torch.Tensor:
    """``[b, s, ...]`` partial sums -> this rank's ``[b, s/t, ...]`` of the sum; no autograd.

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    return reduce_scatter_seq_start(x, group, ledger, token_wise)()


def reduce_scatter_seq_start(x: torch.Tensor, group, ledger: TPLedger | None,
                             token_wise: bool = False):
    """Launch :func:`reduce_scatter_seq` asynchronously; returns ``finish()`` -> ``[b, s/t, ...]``.

    The collective reads its input rank-major: with ``b == 1`` the ``s`` rows already are, so
    the input is used as it is; otherwise one copy reorders ``[b, s, ...]`` to ``[t, b, s/t,
    ...]``, unless ``token_wise``: ``x``'s tokens are already in rank-major order (they came
    from a ``token_wise`` gather). The sum lands in the output directly.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return lambda: x
    local_seq_len(x, n)
    if x.shape[0] == 1 or token_wise:
        inp = x.contiguous().view(n, *x.shape[:SEQ_DIM], x.shape[SEQ_DIM] // n,
                                  *x.shape[SEQ_DIM + 1:])
    else:
        inp = torch.stack(x.chunk(n, dim=SEQ_DIM))  # [t, b, s/t, ...], rank-major, contiguous
    out = torch.empty(inp.shape[1:], dtype=x.dtype, device=x.device)
    if ledger is not None:
        ledger.count("reduce_scatter", tensor_bytes(inp), n)
    work = reduce_scatter_flat(out, inp.flatten(0, 1), group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out

    return finish


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ledger, kind):
        ctx.group, ctx.ledger, ctx.kind = group, ledger, kind
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tp(grad.clone(), ctx.group, ctx.ledger, ctx.kind), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ledger):
        if dist.get_world_size(group) == 1:
            return x
        if x.is_leaf or x._base is not None or not x.is_contiguous():
            return all_reduce_tp(x.clone(), group, ledger)  # not ours to overwrite
        ctx.mark_dirty(x)  # an intermediate (the row-parallel matmul's output): sum in place
        return all_reduce_tp(x, group, ledger)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ledger):
        ctx.group, ctx.ledger = group, ledger
        return all_gather_seq(x, group, ledger)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group, ctx.ledger), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ledger, token_wise):
        ctx.group, ctx.ledger, ctx.token_wise = group, ledger, token_wise
        return reduce_scatter_seq(x, group, ledger, token_wise)

    @staticmethod
    def backward(ctx, grad):
        return (all_gather_seq(grad, ctx.group, ctx.ledger, token_wise=ctx.token_wise), None,
                None, None)


def copy_to_tp(x: torch.Tensor, group, ledger: TPLedger | None = None,
               kind: str = "all_reduce") -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward ("f").

    ``kind`` names the ledger entry (``grad_all_reduce`` for the gradient of a replicated
    parameter under sequence parallelism)."""
    return _CopyToTP.apply(x, group, ledger, kind)


def reduce_from_tp(x: torch.Tensor, group, ledger: TPLedger | None = None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward ("f-bar")."""
    return _ReduceFromTP.apply(x, group, ledger)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """All-gather ``inp`` (``[n]``) from every rank of ``group`` into ``out`` (``[world * n]``, rank
    order).

    ``torch.distributed.all_gather_single`` replaces ``all_gather_into_tensor`` in recent torch;
    it is looked up at call time so that tests can count calls by patching ``torch.distributed``.
    Returns the work handle with ``async_op``, else None.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` (``[n]``) = this rank's chunk of the sum over ``group`` of ``inp`` (``[world * n]``).

    ``torch.distributed.reduce_scatter_single`` replaces ``reduce_scatter_tensor`` in recent
    torch; looked up at call time like :func:`all_gather_flat`. Returns the work handle with
    ``async_op``, else None.
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def gather_sequence(x: torch.Tensor, group, ledger: TPLedger | None = None) -> torch.Tensor:
    """``[b, s/t, h]`` -> ``[b, s, h]`` by all-gather; reduce-scatter of the gradient ("g")."""
    return _GatherSequence.apply(x, group, ledger)


def reduce_scatter_sequence(x: torch.Tensor, group, ledger: TPLedger | None = None,
                            token_wise: bool = False) -> torch.Tensor:
    """``[b, s, h]`` partial sums -> this rank's ``[b, s/t, h]`` of the sum by reduce-scatter;
    all-gather of the gradient backward ("g-bar"). ``token_wise``: ``x`` holds its tokens in
    rank-major order (:func:`gather_seq_start`), and so does the gradient's gather."""
    return _ReduceScatterSequence.apply(x, group, ledger, token_wise)
