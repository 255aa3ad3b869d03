"""The column- and row-parallel linear modules (Megatron-LM paper, arXiv 1909.08053, §3) and
their sequence-parallel forms (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2).

A column-parallel linear splits its weight by output features, a row-parallel one by input
features; under sequence parallelism the first all-gathers its ``[b, s/t, in]`` input along the
sequence and the second reduce-scatters its output (:mod:`hybrid.parallel.layers` for the rest of
the sequence-parallel model).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.parallel.grad_groups import _summed
from hybrid.parallel.linear.collective_matmul import column_sp, row_sp
from hybrid.parallel.linear.functions import column_parallel_linear
from hybrid.parallel.linear.gemm import linear
from hybrid.parallel.linear.shared_input import column_pair
from hybrid.parallel.ops import TPLedger, reduce_from_tp
from hybrid.parallel.tp_spec import TPSpec, set_tp_spec


def _group_coords(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i + b_i``: the weight ``[out, in]`` is split by rows (output features).

    Input ``[..., in]`` (replicated across TP ranks), or ``[b, s/t, in]`` with
    ``sequence_parallel``; output ``[..., out_padded / tp]``, this rank's slice (full sequence).
    ``out_features`` may be padded to ``padded_out`` (a multiple of tp). ``ledger`` counts the
    TP collectives' bytes.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 padded_out: int | None = None, device=None, dtype=None,
                 sequence_parallel: bool = False, ledger: TPLedger | None = None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.ledger = ledger
        self.token_wise = False
        """With ``sequence_parallel``: the output's tokens in rank-major order (no reordering
        copy at micro-batch > 1), for a token-wise consumer ending in a ``token_wise``
        :class:`RowParallelLinear` (the MLP; ``hybrid.parallel.ops._gather_seq_start``)."""
        self.tp_comm_overlap = False
        """With ``sequence_parallel``: the all-gather pipelined with the GEMM
        (``hybrid.parallel.collective_matmul``, ``--tp-comm-overlap``)."""
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
        if self.sequence_parallel:
            return column_sp(self, x, self.bias)
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.ledger)

    def forward_skip_bias(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(forward(x) without the bias, this rank's bias slice or None)``, for a fused
        consumer that adds it (``models.fusion.linear_skip_bias``)."""
        if self.sequence_parallel:
            return column_sp(self, x, None), self.bias
        return column_parallel_linear(x, self.weight, None, self.group, self.ledger), self.bias

    def forward_pair(self, other: nn.Module, x: torch.Tensor, skip_bias: bool = False):
        """``(self(x), other(x))`` (with ``skip_bias`` four values) on one input collective, or
        None (:func:`hybrid.parallel.shared_input.column_pair`)."""
        return column_pair(self, other, x, skip_bias)


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i + b``: the weight ``[out, in]`` is split by columns (input features).

    Input ``[..., in / tp]`` (this rank's slice, e.g. from a column-parallel layer); output
    ``[..., out]`` all-reduced over the TP group, or with ``sequence_parallel`` this rank's
    ``[b, s/t, out]`` of the sum (reduce-scatter); the bias is replicated and added once.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 device=None, dtype=None, sequence_parallel: bool = False,
                 ledger: TPLedger | None = None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.ledger = ledger
        self.token_wise = False
        """With ``sequence_parallel``: the input's tokens are in rank-major order (from a
        ``token_wise`` :class:`ColumnParallelLinear`), reduce-scattered without reordering."""
        self.tp_comm_overlap = False
        """With ``sequence_parallel``: the reduce-scatter pipelined with the GEMM."""
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
        if self.sequence_parallel:
            y = row_sp(self, x)
            return y if self.bias is None else y + _summed(self, "bias")
        y = reduce_from_tp(linear(x, self.weight), self.group, self.ledger)
        return y if self.bias is None else y + self.bias

    def forward_skip_bias(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(forward(x) without the bias, the bias or None)``, for a fused bias-dropout-add
        (``models.fusion.linear_skip_bias``); under sequence parallelism the bias is
        :func:`tp_summed`, as :meth:`forward` adds it."""
        if self.sequence_parallel:
            return row_sp(self, x), None if self.bias is None else _summed(self, "bias")
        return reduce_from_tp(linear(x, self.weight), self.group, self.ledger), self.bias

    def tp_summed_params(self) -> list[str]:
        """``["bias"]`` under sequence parallelism (its gradient is TP-summed), else nothing."""
        return ["bias"] if self.sequence_parallel and self.bias is not None else []
