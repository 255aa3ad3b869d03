"""The autograd functions of the column-parallel linear, with their collectives in bulk.

Megatron-LM paper (arXiv 1909.08053) §3, Figure 3: a column-parallel linear on a replicated input
all-reduces its input gradient in backward ("f"); on a sequence-parallel input (Korthikanti et
al. 2022, arXiv 2205.05198, §4.2.2, Figure 5) it all-gathers the input along the sequence forward
("g") and reduce-scatters the input gradient backward. Each backward overlaps its collective with
a GEMM, as Megatron-LM does. The pipelined (ring) forms are in
:mod:`hybrid.parallel.linear.collective_matmul`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.parallel.linear.gemm import linear, weight_grad
from hybrid.parallel.ops import (
    TPLedger,
    _all_reduce_start,
    _autocast_state,
    _gather_seq_start,
    _reduce_scatter_seq_start,
    all_gather_seq,
)


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear(all_gather_seq(x), weight, bias)`` that keeps only the ``s/t`` input slice for
    backward and all-gathers it again there for the weight gradient (2205.05198 §4.2.2: "Y_i^s
    is stored and all-gathered again in the backward pass")."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, ledger, token_wise):
        ctx.group, ctx.ledger, ctx.has_bias = group, ledger, bias is not None
        ctx.autocast, ctx.token_wise = _autocast_state(x.device), token_wise
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(
            all_gather_seq(x, group, ledger, token_wise=token_wise), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        # Under autocast as the forward ran (what torch.amp.custom_bwd does, for any device),
        # and overlapped as in Megatron-LM: the re-gather runs during the input-gradient GEMM,
        # the input gradient's reduce-scatter during the weight-gradient GEMM.
        x, weight = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return (*sequence_parallel_linear_grads(x, weight, grad, ctx.group, ctx.ledger,
                                                    ctx.token_wise, ctx.has_bias),
                    None, None, None)


def sequence_parallel_linear_grads(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                                   group, ledger: TPLedger | None, token_wise: bool,
                                   has_bias: bool):
    """``(grad_x [b, s/t, in], grad_w [out_local, in], grad_b or None)`` of a column-parallel
    linear on a sequence-parallel input ``x`` (``[b, s/t, in]``, as stored), from its output
    gradient ``grad`` (``[b, s, out_local]``): the re-gather of ``x`` runs during the
    input-gradient GEMM, the input gradient's reduce-scatter during the weight-gradient GEMM
    (2205.05198 §4.2.2; Megatron-LM's overlap)."""
    gathered = _gather_seq_start(x, group, ledger, "regather", token_wise)
    scatter = _reduce_scatter_seq_start(grad.matmul(weight), group, ledger, token_wise)
    full = gathered()
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_w = weight_grad(g2, full.reshape(-1, full.shape[-1]), weight)
    return scatter(), grad_w, g2.sum(0) if has_bias else None


class _ColumnParallelLinear(torch.autograd.Function):
    """``F.linear(copy_to_tp(x), weight, bias)`` whose backward launches the input gradient's
    all-reduce before the weight-gradient GEMM and waits for it after, so the two overlap (as
    Megatron-LM's column-parallel linear does; the sum is the "f" of arXiv 1909.08053 §3,
    Figure 3). On a GPU the all-reduce runs on the process group's own stream, the GEMM on the
    compute stream; ``wait`` only makes the compute stream wait for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, ledger):
        # Autocast's casts made by hand (what it does to F.linear's arguments) so that the
        # 16-bit copies, not the fp32 input, are what backward keeps, as F.linear keeps them.
        kind, enabled, dtype = _autocast_state(x.device)
        ctx.group, ctx.ledger, ctx.has_bias = group, ledger, bias is not None
        ctx.x_dtype = x.dtype
        if enabled and x.is_floating_point():
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        with torch.autocast(kind, enabled=False):
            return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        # The sum runs in the input's dtype, as when the all-reduce followed autocast's cast
        # back (the same bytes and rounding as an all-reduce after F.linear's backward).
        grad_x = work = None
        if ctx.needs_input_grad[0]:  # as "f" before the linear: no input gradient, no sum
            grad_x = grad.matmul(weight).to(ctx.x_dtype)
            work = _all_reduce_start(grad_x, ctx.group, ctx.ledger)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = weight_grad(g2, x.reshape(-1, x.shape[-1]), weight)
        grad_b = g2.sum(0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group, ledger: TPLedger | None = None) -> torch.Tensor:
    """Column-parallel linear on a replicated input: ``[..., in]`` -> ``[..., out_local]``.

    Forward is ``F.linear``; backward all-reduces the input gradient over ``group`` ("f") while
    the weight gradient is computed (launched before that GEMM, waited after it). Equal, bit
    for bit on CPU, to ``F.linear(copy_to_tp(x, group), weight, bias)``, with or without
    autocast. At one rank it is ``F.linear``.
    """
    if dist.get_world_size(group) == 1:
        return linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group, ledger)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group, ledger: TPLedger | None = None,
                             token_wise: bool = False) -> torch.Tensor:
    """Column-parallel linear on a sequence-parallel input: ``[b, s/t, in]`` ->
    ``[b, s, out_local]``.

    Forward all-gathers the input along the sequence ("g"); backward reduce-scatters the input
    gradient and re-gathers the stored ``s/t`` input for the weight gradient. ``token_wise``:
    the output's tokens in the gather's rank-major order, no reordering copy at ``b > 1`` in
    either direction (:func:`_gather_seq_start`; for the MLP, whose row-parallel end
    reduce-scatters ``token_wise`` too).
    """
    return _SequenceParallelLinear.apply(x, weight, bias, group, ledger, token_wise)
