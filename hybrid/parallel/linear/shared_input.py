"""Two column-parallel linears on one input, with one input collective between them.

A SwiGLU MLP (Shazeer 2020, arXiv 2002.05202 Eq. 6) projects the same input through ``gate``
and ``up``. Megatron-LM holds both in one ``linear_fc1`` of ``2 f`` rows, so its tensor-parallel
collectives run once per MLP; two separate :class:`hybrid.parallel.layers.ColumnParallelLinear`
would run each of them twice. Here the two weights stay separate parameters (their names, shapes
and checkpoints unchanged) and share the collectives instead:

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
import torch.nn.functional as F

from hybrid.parallel.linear.gemm import linear, weight_grad
from hybrid.parallel.ops import (
    TPLedger,
    _all_reduce_start,
    _autocast_state,
    _gather_seq_start,
    _reduce_scatter_seq_start,
    all_gather_seq,
)


def _input_grad(grads, weights) -> torch.Tensor:
    """``sum_i grads[i] @ weights[i]`` over the outputs that received a gradient."""
    total = None
    for g, w in zip(grads, weights, strict=True):
        if g is not None:
            total = g.matmul(w) if total is None else total.add_(g.matmul(w))
    return total


def _weight_grads(grads, x2: torch.Tensor, weights, has_bias) -> list:
    """``[grad_w0, grad_b0, grad_w1, grad_b1]`` from ``x2`` (``[tokens, in]``); each weight
    gradient through :func:`hybrid.parallel.wgrad.weight_grad`."""
    out = []
    for g, w, bias in zip(grads, weights, has_bias, strict=True):
        if g is None:
            out += [None, None]
            continue
        g2 = g.reshape(-1, g.shape[-1])
        out += [weight_grad(g2, x2, w), g2.sum(0) if bias else None]
    return out


class _SharedSequenceParallelLinears(torch.autograd.Function):
    """Two ``_SequenceParallelLinear`` (:mod:`hybrid.parallel.ops`) on one gathered input."""

    @staticmethod
    def forward(ctx, x, w0, b0, w1, b1, group, ledger, token_wise):
        ctx.group, ctx.ledger, ctx.token_wise = group, ledger, token_wise
        ctx.has_bias = (b0 is not None, b1 is not None)
        ctx.autocast = _autocast_state(x.device)
        ctx.save_for_backward(x, w0, w1)
        full = all_gather_seq(x, group, ledger, token_wise=token_wise)
        return F.linear(full, w0, b0), F.linear(full, w1, b1)

    @staticmethod
    def backward(ctx, g0, g1):
        # As _SequenceParallelLinear: the re-gather overlaps the input-gradient GEMMs, the
        # reduce-scatter of their sum the weight-gradient GEMMs.
        x, w0, w1 = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            gathered = _gather_seq_start(x, ctx.group, ctx.ledger, "regather", ctx.token_wise)
            scatter = _reduce_scatter_seq_start(_input_grad((g0, g1), (w0, w1)), ctx.group,
                                                ctx.ledger, ctx.token_wise)
            full = gathered()
            grads = _weight_grads((g0, g1), full.reshape(-1, full.shape[-1]), (w0, w1),
                                  ctx.has_bias)
            return (scatter(), *grads, None, None, None)


class _SharedColumnParallelLinears(torch.autograd.Function):
    """Two ``_ColumnParallelLinear`` (:mod:`hybrid.parallel.ops`) on one replicated input."""

    @staticmethod
    def forward(ctx, x, w0, b0, w1, b1, group, ledger):
        kind, enabled, dtype = _autocast_state(x.device)
        ctx.group, ctx.ledger, ctx.x_dtype = group, ledger, x.dtype
        ctx.has_bias = (b0 is not None, b1 is not None)
        if enabled and x.is_floating_point():  # autocast's casts, by hand (see ops)
            x, w0, w1 = x.to(dtype), w0.to(dtype), w1.to(dtype)
            b0 = None if b0 is None else b0.to(dtype)
            b1 = None if b1 is None else b1.to(dtype)
        ctx.save_for_backward(x, w0, w1)
        with torch.autocast(kind, enabled=False):
            return F.linear(x, w0, b0), F.linear(x, w1, b1)

    @staticmethod
    def backward(ctx, g0, g1):
        x, w0, w1 = ctx.saved_tensors
        grads = [None if g is None else g.to(w0.dtype) for g in (g0, g1)]
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grads, (w0, w1)).to(ctx.x_dtype)
            work = _all_reduce_start(grad_x, ctx.group, ctx.ledger)
        weight_grads = _weight_grads(grads, x.reshape(-1, x.shape[-1]), (w0, w1), ctx.has_bias)
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
    the collectives are no-ops and this is two ``F.linear``.
    """
    (w0, b0), (w1, b1) = first, second
    b0, b1 = (b0, b1) if with_bias else (None, None)
    if sequence_parallel:
        return _SharedSequenceParallelLinears.apply(x, w0, b0, w1, b1, group, ledger,
                                                    token_wise)
    if torch.distributed.get_world_size(group) == 1:
        return linear(x, w0, b0), linear(x, w1, b1)
    return _SharedColumnParallelLinears.apply(x, w0, b0, w1, b1, group, ledger)


def column_pair(first, second, x: torch.Tensor, skip_bias: bool = False):
    """``(first(x), second(x))`` for two column-parallel linears of one form (the same class,
    group, sequence parallelism and token order) on one input collective, or with ``skip_bias``
    ``(y_first, bias_first, y_second, bias_second)`` (the biases left to the caller); None when
    ``second`` is not of ``first``'s form, or under ``--tp-comm-overlap`` (each linear's gather
    is then a ring pipelined with its own GEMM, :mod:`hybrid.parallel.collective_matmul`): the
    caller runs each on its own."""
    form = ("group", "sequence_parallel", "token_wise", "tp_comm_overlap")
    if (type(second) is not type(first) or getattr(first, "tp_comm_overlap", False)
            or any(getattr(second, k) is not getattr(first, k) for k in form)):
        return None
    y0, y1 = shared_input_linears(x, (first.weight, first.bias), (second.weight, second.bias),
                                  first.group, first.ledger, first.sequence_parallel,
                                  first.token_wise, with_bias=not skip_bias)
    return (y0, first.bias, y1, second.bias) if skip_bias else (y0, y1)

