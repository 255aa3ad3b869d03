"""The tensor-parallel linears with their collectives in bulk: one collective per GEMM input or
output, overlapped in backward with a GEMM that does not need it (as Megatron-LM does).

Megatron-LM paper (arXiv 1909.08053) §3, Figure 3, and its sequence-parallel form (Korthikanti et
al. 2022, arXiv 2205.05198, §4.2.2, Figure 5):

- :func:`column_parallel_linear`: a replicated input; backward all-reduces the input gradient
  ("f") during the weight-gradient GEMM.
- :func:`sequence_parallel_linear`: a ``[b, s/t, in]`` input all-gathered along the sequence
  ("g"); backward re-gathers the stored slice during the input-gradient GEMM and reduce-scatters
  the input gradient during the weight-gradient GEMM.
- :func:`linear_all_reduce` and :func:`linear_reduce_scatter`: the row-parallel product, summed
  over the group ("f-bar"), or reduce-scattered along the sequence ("g-bar").

Every GEMM and every cast is :mod:`hybrid.parallel.linear.gemm`'s (one :class:`CastPolicy` per
forward, kept for its backward). The pipelined (ring) forms of ``--tp-comm-overlap`` are
:mod:`hybrid.parallel.linear.collective_matmul`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.parallel.linear.gemm import CastPolicy, cast_policy, linear
from hybrid.parallel.ops import (
    TPLedger,
    all_gather_seq,
    all_reduce_start,
    gather_seq_start,
    reduce_from_tp,
    reduce_scatter_seq_start,
    reduce_scatter_sequence,
)


def sequence_parallel_linear_grads(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                                   group, ledger: TPLedger | None, token_wise: bool,
                                   has_bias: bool, policy: CastPolicy, x_dtype: torch.dtype):
    """``(grad_x [b, s/t, in], grad_w [out_local, in], grad_b or None)`` of a column-parallel
    linear on a sequence-parallel input ``x`` (``[b, s/t, in]``, as stored: cast by ``policy``),
    from its output gradient ``grad`` (``[b, s, out_local]``): the re-gather of ``x`` runs during
    the input-gradient GEMM, the input gradient's reduce-scatter during the weight-gradient GEMM
    (2205.05198 §4.2.2; Megatron-LM's overlap). The input gradient is summed in the GEMMs' dtype
    and returned in ``x_dtype`` (the forward input's)."""
    grad = policy.cast_grad(grad, weight)
    gathered = gather_seq_start(x, group, ledger, "regather", token_wise)
    scatter = reduce_scatter_seq_start(policy.dgrad(grad, weight), group, ledger, token_wise)
    full = gathered()
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_w = policy.wgrad(g2, full.reshape(-1, full.shape[-1]), weight)
    return scatter().to(x_dtype), grad_w, g2.sum(0) if has_bias else None


def bulk_gather_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                     ledger: TPLedger | None, token_wise: bool,
                     policy: CastPolicy) -> torch.Tensor:
    """``[b, s, out_local]``: ``x`` (``[b, s/t, in]``, cast) all-gathered along the sequence, then
    one GEMM (the forward of :func:`sequence_parallel_linear`; the ring's is
    :func:`hybrid.parallel.linear.collective_matmul.ring_gather_linear`)."""
    return policy.forward(all_gather_seq(x, group, ledger, token_wise=token_wise), weight, bias)


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear(all_gather_seq(x), weight, bias)`` that keeps only the ``s/t`` input slice for
    backward and all-gathers it again there for the weight gradient (2205.05198 §4.2.2: "Y_i^s
    is stored and all-gathered again in the backward pass"). ``gather_gemm`` computes the
    forward from the cast operands: in bulk (:func:`bulk_gather_gemm`) or on the ring."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, ledger, token_wise, gather_gemm):
        policy = cast_policy(x.device)
        ctx.group, ctx.ledger, ctx.has_bias = group, ledger, bias is not None
        ctx.policy, ctx.token_wise, ctx.x_dtype = policy, token_wise, x.dtype
        x, weight = policy.cast_input(x), policy.cast_weight(weight)
        ctx.save_for_backward(x, weight)
        return gather_gemm(x, weight, policy.cast_bias(bias), group, ledger, token_wise, policy)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*sequence_parallel_linear_grads(x, weight, grad, ctx.group, ctx.ledger,
                                                ctx.token_wise, ctx.has_bias, ctx.policy,
                                                ctx.x_dtype),
                None, None, None, None)


class _ColumnParallelLinear(torch.autograd.Function):
    """``F.linear(copy_to_tp(x), weight, bias)`` whose backward launches the input gradient's
    all-reduce before the weight-gradient GEMM and waits for it after, so the two overlap (as
    Megatron-LM's column-parallel linear does; the sum is the "f" of arXiv 1909.08053 §3,
    Figure 3). On a GPU the all-reduce runs on the process group's own stream, the GEMM on the
    compute stream; ``wait`` only makes the compute stream wait for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, ledger):
        policy = cast_policy(x.device)
        ctx.group, ctx.ledger, ctx.has_bias = group, ledger, bias is not None
        ctx.policy, ctx.x_dtype = policy, x.dtype
        x, weight = policy.cast_input(x), policy.cast_weight(weight)
        ctx.save_for_backward(x, weight)
        return policy.forward(x, weight, policy.cast_bias(bias))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        policy = ctx.policy
        grad = policy.cast_grad(grad, weight)
        # The sum runs in the input's dtype, as when the all-reduce followed autocast's cast
        # back (the same bytes and rounding as an all-reduce after F.linear's backward).
        grad_x = work = None
        if ctx.needs_input_grad[0]:  # as "f" before the linear: no input gradient, no sum
            grad_x = policy.dgrad(grad, weight).to(ctx.x_dtype)
            work = all_reduce_start(grad_x, ctx.group, ctx.ledger)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = policy.wgrad(g2, x.reshape(-1, x.shape[-1]), weight)
        grad_b = g2.sum(0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group, ledger: TPLedger | None = None,
                           token_wise: bool = False) -> torch.Tensor:
    """Column-parallel linear on a replicated input: ``[..., in]`` -> ``[..., out_local]``.

    Forward is ``F.linear``; backward all-reduces the input gradient over ``group`` ("f") while
    the weight gradient is computed (launched before that GEMM, waited after it). Equal, bit
    for bit on CPU, to ``F.linear(copy_to_tp(x, group), weight, bias)``, with or without
    autocast. At one rank it is :func:`hybrid.parallel.linear.gemm.linear`. ``token_wise`` is
    without effect (no sequence split; taken so that every column-parallel form has one
    signature).
    """
    if dist.get_world_size(group) == 1:
        return linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group, ledger)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group, ledger: TPLedger | None = None, token_wise: bool = False,
                             gather_gemm=bulk_gather_gemm) -> torch.Tensor:
    """Column-parallel linear on a sequence-parallel input: ``[b, s/t, in]`` ->
    ``[b, s, out_local]``.

    Forward all-gathers the input along the sequence ("g"); backward reduce-scatters the input
    gradient and re-gathers the stored ``s/t`` input for the weight gradient. ``token_wise``:
    the output's tokens in the gather's rank-major order, no reordering copy at ``b > 1`` in
    either direction (:func:`hybrid.parallel.ops.gather_seq_start`; for the MLP, whose
    row-parallel end reduce-scatters ``token_wise`` too). Under autocast the input is cast
    before the gather, so the collectives move the 16-bit copy. ``gather_gemm``: the forward's
    gather and GEMM (:func:`bulk_gather_gemm`, or ``--tp-comm-overlap``'s ring); the backward is
    the same either way.
    """
    return _SequenceParallelLinear.apply(x, weight, bias, group, ledger, token_wise, gather_gemm)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group,
                      ledger: TPLedger | None = None, token_wise: bool = False) -> torch.Tensor:
    """Row-parallel linear without its bias: ``[..., in_local]`` -> ``[..., out]``, the sum over
    ``group`` of this rank's product (``reduce_from_tp``, "f-bar"). ``token_wise`` is without
    effect (one signature with :func:`linear_reduce_scatter`)."""
    return reduce_from_tp(linear(x, weight), group, ledger)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group,
                          ledger: TPLedger | None = None,
                          token_wise: bool = False) -> torch.Tensor:
    """Row-parallel linear without its bias under sequence parallelism: ``[b, s, in_local]`` ->
    this rank's ``[b, s/t, out]`` of the sum (``reduce_scatter_sequence``, "g-bar"; ``token_wise``
    as there).

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    return reduce_scatter_sequence(linear(x, weight), group, ledger, token_wise)
