"""Two column-parallel linears on one input, with one input collective between them.

A SwiGLU MLP (Shazeer 2020, arXiv 2002.05202 Eq. 6) projects the same input through ``gate``
and ``up``. Megatron-LM holds both in one ``linear_fc1`` of ``2 f`` rows, so its tensor-parallel
collectives run once per MLP; two separate column-parallel linears
(:class:`hybrid.parallel.linear.modules.ColumnParallelLinear`) would run each of them twice. Here
the two weights stay separate parameters (their names, shapes and checkpoints unchanged) and
share the collectives instead (:func:`shared_input_linears`, which the column-parallel linear's
``forward_pair`` calls):

- sequence parallel (arXiv 2205.05198 §4.2.2): one all-gather of ``[b, s/t, h]`` forward, one
  re-gather and one reduce-scatter of the summed input gradient backward (two of each before);
- tensor parallel without it (arXiv 1909.08053 §3, "f"): one all-reduce of the summed input
  gradient backward (two before).

Per Llama block under sequence parallelism that is 4 collectives forward and 6 backward, as in
Megatron-LM, instead of 5 and 8. The outputs are bit for bit those of the two linears; the input
gradient is the same sum taken in another order (the two products are added before the
collective rather than after), equal within fp32 rounding.
"""

from __future__ import annotations

import torch

from hybrid.parallel.linear.gemm import CastPolicy, cast_policy, linear
from hybrid.parallel.ops import (
    TPLedger,
    all_gather_seq,
    all_reduce_start,
    gather_seq_start,
    reduce_scatter_seq_start,
)


def _input_grad(grads, weights, policy: CastPolicy) -> torch.Tensor:
    """``sum_i grads[i] @ weights[i]`` over the outputs that received a gradient."""
    total = None
    for g, w in zip(grads, weights, strict=True):
        if g is not None:
            dx = policy.dgrad(g, w)
            total = dx if total is None else total.add_(dx)
    return total


def _weight_grads(grads, x2: torch.Tensor, weights, has_bias, policy: CastPolicy) -> list:
    """``[grad_w0, grad_b0, grad_w1, grad_b1]`` from ``x2`` (``[tokens, in]``); each weight
    gradient :meth:`hybrid.parallel.linear.gemm.CastPolicy.wgrad`."""
    out = []
    for g, w, bias in zip(grads, weights, has_bias, strict=True):
        if g is None:
            out += [None, None]
            continue
        g2 = g.reshape(-1, g.shape[-1])
        out += [policy.wgrad(g2, x2, w), g2.sum(0) if bias else None]
    return out


def _cast_forward(ctx, x, w0, b0, w1, b1):
    """The forward's :class:`CastPolicy` on ``ctx`` (with the input's dtype and which biases
    exist) and the operands it casts: ``(policy, x, w0, b0, w1, b1)``."""
    policy = ctx.policy = cast_policy(x.device)
    ctx.x_dtype, ctx.has_bias = x.dtype, (b0 is not None, b1 is not None)
    cast_w, cast_b = policy.cast_weight, policy.cast_bias
    return policy, policy.cast_input(x), cast_w(w0), cast_b(b0), cast_w(w1), cast_b(b1)


class _SharedSequenceParallelLinears(torch.autograd.Function):
    """Two sequence-parallel linears (:mod:`hybrid.parallel.linear.functions`) on one gathered
    input."""

    @staticmethod
    def forward(ctx, x, w0, b0, w1, b1, group, ledger, token_wise):
        ctx.group, ctx.ledger, ctx.token_wise = group, ledger, token_wise
        policy, x, w0, b0, w1, b1 = _cast_forward(ctx, x, w0, b0, w1, b1)
        ctx.save_for_backward(x, w0, w1)
        full = all_gather_seq(x, group, ledger, token_wise=token_wise)
        return policy.forward(full, w0, b0), policy.forward(full, w1, b1)

    @staticmethod
    def backward(ctx, g0, g1):
        # As the sequence-parallel linear: the re-gather overlaps the input-gradient GEMMs, the
        # reduce-scatter of their sum the weight-gradient GEMMs.
        x, w0, w1 = ctx.saved_tensors
        policy = ctx.policy
        grads = [None if g is None else policy.cast_grad(g, w0) for g in (g0, g1)]
        gathered = gather_seq_start(x, ctx.group, ctx.ledger, "regather", ctx.token_wise)
        scatter = reduce_scatter_seq_start(_input_grad(grads, (w0, w1), policy), ctx.group,
                                           ctx.ledger, ctx.token_wise)
        full = gathered()
        weight_grads = _weight_grads(grads, full.reshape(-1, full.shape[-1]), (w0, w1),
                                     ctx.has_bias, policy)
        return (scatter().to(ctx.x_dtype), *weight_grads, None, None, None)


class _SharedColumnParallelLinears(torch.autograd.Function):
    """Two column-parallel linears (:mod:`hybrid.parallel.linear.functions`) on one replicated
    input."""

    @staticmethod
    def forward(ctx, x, w0, b0, w1, b1, group, ledger):
        ctx.group, ctx.ledger = group, ledger
        policy, x, w0, b0, w1, b1 = _cast_forward(ctx, x, w0, b0, w1, b1)
        ctx.save_for_backward(x, w0, w1)
        return policy.forward(x, w0, b0), policy.forward(x, w1, b1)

    @staticmethod
    def backward(ctx, g0, g1):
        x, w0, w1 = ctx.saved_tensors
        policy = ctx.policy
        grads = [None if g is None else policy.cast_grad(g, w0) for g in (g0, g1)]
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grads, (w0, w1), policy).to(ctx.x_dtype)
            work = all_reduce_start(grad_x, ctx.group, ctx.ledger)
        weight_grads = _weight_grads(grads, x.reshape(-1, x.shape[-1]), (w0, w1), ctx.has_bias,
                                     policy)
        if work is not None:
            work.wait()
        return (grad_x, *weight_grads, None, None)


def shared_input_linears(x: torch.Tensor, first, second, group, ledger: TPLedger | None,
                         sequence_parallel: bool, token_wise: bool, with_bias: bool):
    """``(first(x), second(x))`` for two column-parallel linears' ``(weight, bias)`` pairs,
    with one input collective (see the module docstring).

    ``x``: ``[b, s/t, in]`` with ``sequence_parallel``, else ``[..., in]`` (replicated); each
    output ``[b, s, out_local]`` / ``[..., out_local]``. ``with_bias``: add the biases (as
    ``F.linear`` does); otherwise they are left to the caller (``skip_bias_add``). At one rank
    the collectives are no-ops and this is two :func:`hybrid.parallel.linear.gemm.linear`.
    """
    (w0, b0), (w1, b1) = first, second
    b0, b1 = (b0, b1) if with_bias else (None, None)
    if sequence_parallel:
        return _SharedSequenceParallelLinears.apply(x, w0, b0, w1, b1, group, ledger,
                                                    token_wise)
    if torch.distributed.get_world_size(group) == 1:
        return linear(x, w0, b0), linear(x, w1, b1)
    return _SharedColumnParallelLinears.apply(x, w0, b0, w1, b1, group, ledger)
