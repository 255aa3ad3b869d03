"""The column- and row-parallel linear modules (Megatron-LM paper, arXiv 1909.08053, §3) and
their sequence-parallel forms (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2).

A column-parallel linear splits its weight by output features, a row-parallel one by input
features; under sequence parallelism the first all-gathers its ``[b, s/t, in]`` input along the
sequence and the second reduce-scatters its output. Each module picks its forward once, at
construction, from ``sequence_parallel`` and ``tp_comm_overlap``: the bulk collectives of
:mod:`hybrid.parallel.linear.functions`, or under ``--tp-comm-overlap`` the rings of
:mod:`hybrid.parallel.linear.collective_matmul` (:data:`COLUMN_FORWARDS`,
:data:`ROW_FORWARDS`). Two column-parallel linears of one form on one input (SwiGLU's gate and
up) share its collectives (:meth:`ColumnParallelLinear.forward_pair`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.parallel.grad_groups import summed_param
from hybrid.parallel.linear.collective_matmul import gather_linear, linear_scatter
from hybrid.parallel.linear.functions import (
    column_parallel_linear,
    linear_all_reduce,
    linear_reduce_scatter,
    sequence_parallel_linear,
)
from hybrid.parallel.linear.shared_input import shared_input_linears
from hybrid.parallel.ops import TPLedger
from hybrid.parallel.sequence import TP_COMM_OVERLAP_NEEDS_SP
from hybrid.parallel.tp_spec import TPSpec, set_tp_spec

COLUMN_FORWARDS: dict[tuple[bool, bool], Callable] = {
    (False, False): column_parallel_linear,
    (True, False): sequence_parallel_linear,
    (True, True): gather_linear,
}
"""``(sequence_parallel, tp_comm_overlap)`` -> the column-parallel forward
``(x, weight, bias, group, ledger, token_wise) -> y``."""

ROW_FORWARDS: dict[tuple[bool, bool], Callable] = {
    (False, False): linear_all_reduce,
    (True, False): linear_reduce_scatter,
    (True, True): linear_scatter,
}
"""``(sequence_parallel, tp_comm_overlap)`` -> the row-parallel forward without the bias
``(x, weight, group, ledger, token_wise) -> y``."""


def _pick(table: dict, sequence_parallel: bool, tp_comm_overlap: bool) -> Callable:
    """The forward of ``table`` for the two choices.

    Raises:
        ValueError: ``tp_comm_overlap`` without ``sequence_parallel``.
    """
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError(f"tp_comm_overlap {TP_COMM_OVERLAP_NEEDS_SP} (sequence_parallel is "
                         "off for this layer)")
    return table[(bool(sequence_parallel), bool(tp_comm_overlap))]


def _group_coords(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i + b_i``: the weight ``[out, in]`` is split by rows (output features).

    Input ``[..., in]`` (replicated across TP ranks), or ``[b, s/t, in]`` with
    ``sequence_parallel``; output ``[..., out_padded / tp]``, this rank's slice (full sequence).
    ``out_features`` may be padded to ``padded_out`` (a multiple of tp). ``ledger`` counts the
    TP collectives' bytes. ``token_wise`` (with ``sequence_parallel``): the output's tokens in
    rank-major order (no reordering copy at micro-batch > 1), for a token-wise consumer ending
    in a ``token_wise`` :class:`RowParallelLinear` (the MLP;
    ``hybrid.parallel.ops.gather_seq_start``). ``tp_comm_overlap`` (with ``sequence_parallel``):
    the all-gather pipelined with the GEMM (``--tp-comm-overlap``).

    Raises:
        ValueError: ``padded_out`` not divisible by the TP size; ``tp_comm_overlap`` without
            ``sequence_parallel``.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 padded_out: int | None = None, device=None, dtype=None,
                 sequence_parallel: bool = False, ledger: TPLedger | None = None,
                 token_wise: bool = False, tp_comm_overlap: bool = False):
        super().__init__()
        self.group, self.ledger = group, ledger
        self.sequence_parallel, self.token_wise = sequence_parallel, token_wise
        self.tp_comm_overlap = tp_comm_overlap
        self._forward = _pick(COLUMN_FORWARDS, sequence_parallel, tp_comm_overlap)
        self._pair = None if tp_comm_overlap else shared_input_linears
        """The shared-input pair's forward, or None under ``--tp-comm-overlap`` (each linear's
        gather is then a ring pipelined with its own GEMM)."""
        rank, size = _group_coords(group)
        padded_out = padded_out or out_features
        if padded_out % size:
            raise ValueError(f"output features {padded_out} are not divisible by the TP size "
                             f"{size}")
        local = padded_out // size
        self.weight = _param((local, in_features), device, dtype)
        set_tp_spec(self.weight, TPSpec(0, (out_features, in_features), padded_out, rank, size))
        if bias:
            self.bias = _param((local,), device, dtype)
            set_tp_spec(self.bias, TPSpec(0, (out_features,), padded_out, rank, size))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight, self.bias, self.group, self.ledger, self.token_wise)

    def forward_skip_bias(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(forward(x) without the bias, this rank's bias slice or None)``, for a fused
        consumer that adds it (``models.fusion.linear_skip_bias``)."""
        return (self._forward(x, self.weight, None, self.group, self.ledger, self.token_wise),
                self.bias)

    def forward_pair(self, other: nn.Module, x: torch.Tensor, skip_bias: bool = False):
        """``(self(x), other(x))``, or with ``skip_bias`` ``(y_self, bias_self, y_other,
        bias_other)`` (the biases left to the caller), on one input collective
        (:mod:`hybrid.parallel.linear.shared_input`); None when ``other`` is not of this form
        (the same class, group, forward and token order) or under ``--tp-comm-overlap``: the
        caller runs each on its own (``models.fusion.linear_pair``)."""
        form = ("group", "_forward", "token_wise")
        if (self._pair is None or type(other) is not type(self)
                or any(getattr(other, k) is not getattr(self, k) for k in form)):
            return None
        y0, y1 = self._pair(x, (self.weight, self.bias), (other.weight, other.bias), self.group,
                            self.ledger, self.sequence_parallel, self.token_wise,
                            with_bias=not skip_bias)
        return (y0, self.bias, y1, other.bias) if skip_bias else (y0, y1)


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i + b``: the weight ``[out, in]`` is split by columns (input features).

    Input ``[..., in / tp]`` (this rank's slice, e.g. from a column-parallel layer); output
    ``[..., out]`` all-reduced over the TP group, or with ``sequence_parallel`` this rank's
    ``[b, s/t, out]`` of the sum (reduce-scatter); the bias is replicated and added once.
    ``token_wise`` (with ``sequence_parallel``): the input's tokens are in rank-major order (from
    a ``token_wise`` :class:`ColumnParallelLinear`), reduce-scattered without reordering.
    ``tp_comm_overlap`` (with ``sequence_parallel``): the reduce-scatter pipelined with the GEMM.

    Raises:
        ValueError: ``in_features`` not divisible by the TP size; ``tp_comm_overlap`` without
            ``sequence_parallel``.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 device=None, dtype=None, sequence_parallel: bool = False,
                 ledger: TPLedger | None = None, token_wise: bool = False,
                 tp_comm_overlap: bool = False):
        super().__init__()
        self.group, self.ledger = group, ledger
        self.sequence_parallel, self.token_wise = sequence_parallel, token_wise
        self.tp_comm_overlap = tp_comm_overlap
        self._forward = _pick(ROW_FORWARDS, sequence_parallel, tp_comm_overlap)
        self.grad_group = None
        """The unit's ``hybrid.parallel.grad_groups.TPSummedGroup`` (SP bias), or None."""
        rank, size = _group_coords(group)
        if in_features % size:
            raise ValueError(f"input features {in_features} are not divisible by the TP size "
                             f"{size}")
        self.weight = _param((out_features, in_features // size), device, dtype)
        set_tp_spec(self.weight, TPSpec(1, (out_features, in_features), in_features, rank, size))
        if bias:
            self.bias = _param((out_features,), device, dtype)
            set_tp_spec(self.bias, TPSpec(None, (out_features,), 0, rank, size))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.forward_skip_bias(x)
        return y if bias is None else y + bias

    def forward_skip_bias(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(forward(x) without the bias, the bias or None)``, for a fused bias-dropout-add
        (``models.fusion.linear_skip_bias``); under sequence parallelism the bias is
        :func:`hybrid.parallel.grad_groups.tp_summed`, as :meth:`forward` adds it."""
        y = self._forward(x, self.weight, self.group, self.ledger, self.token_wise)
        if self.bias is None or not self.sequence_parallel:
            return y, self.bias
        return y, summed_param(self, "bias")

    def tp_summed_params(self) -> list[str]:
        """``["bias"]`` under sequence parallelism (its gradient is TP-summed), else nothing."""
        return ["bias"] if self.sequence_parallel and self.bias is not None else []
