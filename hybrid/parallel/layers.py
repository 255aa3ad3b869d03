"""Tensor-parallel layers (Megatron-LM paper, §3), their sequence-parallel forms
(Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2) and the per-parameter TP spec.

With ``sequence_parallel=True`` the activations between tensor-parallel regions (LayerNorms,
dropouts, residuals) are ``[b, s/t, h]`` on each rank: a column-parallel layer all-gathers its
input along the sequence (and keeps only the slice for backward), a row-parallel layer
reduce-scatters its output, the vocab-parallel embedding reduce-scatters its lookup and the
output layer all-gathers the final LayerNorm's output. Replicated parameters used on a slice
(LayerNorms, row-parallel biases, positions) get their gradient all-reduced over the TP group
in backward (:func:`tp_summed`), so ``param.grad`` is the full gradient on every TP rank
before any ZeRO reduction sees it.

Every parameter of a tensor-parallel model carries a :class:`TPSpec` (``param.tp_spec``):
which dimension is split over the TP group (or ``None`` when replicated), the full unpadded
shape, and the padded size along the split dimension. ZeRO, gradient clipping, checkpoints and
consolidation read it instead of re-deriving the sharding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel.collective_matmul import column_sp, row_sp
from hybrid.parallel.ops import (
    TPLedger,
    column_parallel_linear,
    copy_to_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    sequence_parallel_linear,
)
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.shared_input import column_pair
from hybrid.parallel.wgrad import linear


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is laid out over the tensor-parallel group.

    Attributes:
        split_dim: dimension split across TP ranks, or ``None`` for a replicated parameter.
        full_shape: global shape without padding (what a single-process model holds).
        padded_size: global size along ``split_dim`` after padding to a multiple of ``tp_size``
            (equal to ``full_shape[split_dim]`` when nothing is padded).
        tp_rank: this rank's index in the TP group.
        tp_size: TP group size.
    """

    split_dim: int | None
    full_shape: tuple[int, ...]
    padded_size: int
    tp_rank: int
    tp_size: int

    @property
    def replicated(self) -> bool:
        return self.split_dim is None

    def local_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this rank's shard along ``split_dim``, in padded coordinates."""
        if self.replicated:
            return 0, 0
        per = self.padded_size // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def real_local_size(self) -> int:
        """Rows of this rank's shard that are real (not padding) along ``split_dim``."""
        start, stop = self.local_range()
        return max(0, min(stop, self.full_shape[self.split_dim]) - start)

    def real_numel(self) -> int:
        """Elements of the local shard that are not padding (all of them when replicated)."""
        n = 1
        for d, size in enumerate(self.full_shape):
            n *= self.real_local_size() if d == self.split_dim else size
        return n

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's (zero-padded) shard of the full tensor ``full`` (shape ``full_shape``)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got "
                             f"{tuple(full.shape)}")
        if self.replicated:
            return full
        start, stop = self.local_range()
        real = self.real_local_size()
        shape = list(full.shape)
        shape[self.split_dim] = stop - start
        out = full.new_zeros(shape)
        if real > 0:
            out.narrow(self.split_dim, 0, real).copy_(full.narrow(self.split_dim, start, real))
        return out


def get_tp_spec(param: torch.Tensor) -> TPSpec:
    """The parameter's :class:`TPSpec`; a plain parameter counts as replicated on one rank."""
    spec = getattr(param, "tp_spec", None)
    if spec is None:
        spec = TPSpec(None, tuple(param.shape), 0, 0, 1)
    return spec


def set_tp_spec(param: torch.Tensor, spec: TPSpec) -> None:
    """Attach ``spec`` to ``param`` (``param.tp_spec``)."""
    param.tp_spec = spec


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


class VocabParallelEmbedding(nn.Module):
    """Embedding ``[V, h]`` split by vocabulary rows over the TP group (Megatron-LM §3).

    The vocabulary is padded to ``padded_vocab`` (a multiple of tp); padded rows are zero and,
    with :class:`hybrid.parallel.cross_entropy.VocabParallelLoss`, never receive gradient.
    Input ids ``[b, s]``; output ``[b, s, h]``, all-reduced so every TP rank holds all of it,
    or with ``sequence_parallel`` this rank's ``[b, s/t, h]`` (reduce-scatter).
    """

    def __init__(self, vocab_size: int, padded_vocab: int, embedding_dim: int, group,
                 device=None, dtype=None, sequence_parallel: bool = False,
                 ledger: TPLedger | None = None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.ledger = ledger
        rank, size = _group_coords(group)
        if padded_vocab % size or padded_vocab < vocab_size:
            raise ValueError(f"padded vocabulary {padded_vocab} must be >= {vocab_size} and "
                             f"divisible by TP size {size}")
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab
        self.weight = _param((padded_vocab // size, embedding_dim), device, dtype)
        spec = TPSpec(0, (vocab_size, embedding_dim), padded_vocab, rank, size)
        set_tp_spec(self.weight, spec)
        self.vocab_start, self.vocab_end = spec.local_range()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.group, self.ledger)
        return reduce_from_tp(out, self.group, self.ledger)


class ParallelOutputLayer(nn.Module):
    """Local logits ``[b, s, V_padded / tp] = h @ W_i.T`` from replicated hidden ``[b, s, h]``.

    The logits stay split: the vocab-parallel loss consumes them with all-reduces of ``b*s``
    values instead of gathering ``b*s*V`` logits (Megatron-LM §3). With ``sequence_parallel``
    the hidden input is this rank's ``[b, s/t, h]`` and is all-gathered along the sequence.
    """

    def __init__(self, group, sequence_parallel: bool = False, ledger: TPLedger | None = None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.ledger = ledger

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_linear(hidden, weight, None, self.group, self.ledger)
        return column_parallel_linear(hidden, weight, None, self.group, self.ledger)


class TPRegionDropout(nn.Module):
    """Dropout inside a tensor-parallel region: masks come from the TP rank's own RNG stream
    (Megatron-LM Appendix B.2), so different TP ranks drop different heads' probabilities.

    Attention does not call it: it draws its mask inside ``F.scaled_dot_product_attention``
    within :meth:`rng_scope` (``models.blocks.dropout_rng_scope``)."""

    def __init__(self, p: float, tracker: RNGTracker):
        super().__init__()
        self.p = p
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork():
            return F.dropout(x, self.p, True)

    def rng_scope(self):
        """Context in which the TP rank's stream is the default generator (for a mask drawn
        inside a fused kernel, as attention's)."""
        return self.tracker.fork()


def tp_summed(param: torch.Tensor, group, ledger: TPLedger | None = None) -> torch.Tensor:
    """``param`` unchanged forward; its gradient all-reduced (summed) over ``group`` backward.

    For a replicated parameter used on this rank's ``s/t`` slice under sequence parallelism:
    each rank's gradient is the slice's part and the sum is the single-process gradient
    (2205.05198 §4.2.2; Megatron-LM all-reduces LayerNorm gradients the same way). Recorded as
    ``grad_all_reduce`` in the ledger.
    """
    return copy_to_tp(param, group, ledger, "grad_all_reduce")


def _summed(module: nn.Module, name: str) -> torch.Tensor:
    """:func:`tp_summed` of ``module``'s parameter ``name``, through the module's unit-wide group
    when it has one (``hybrid.parallel.grad_groups``: one all-reduce per block instead of one
    per parameter)."""
    if module.grad_group is not None:
        return module.grad_group.take(module, name)
    return tp_summed(getattr(module, name), module.group, module.ledger)


class SequenceParallelLayerNorm(nn.Module):
    """A LayerNorm or RMSNorm whose replicated weight (and bias) — the same Parameter objects as
    the module it replaces — get TP-summed gradients (:func:`tp_summed`).

    Used where each TP rank normalises different data with the same weights: the ``[b, s/t, h]``
    slices of sequence parallelism, and the per-head q/k norms of ``qk_layernorm`` (each rank
    holds other heads, so the weight's gradient is the sum over ranks; tp > 1 with or without
    sequence parallelism).

    The arithmetic is the wrapped norm's own (:meth:`models.norms.NormArithmetic.normalize`,
    kept as the submodule ``norm``, a copy without parameters): this wrapper only substitutes the
    TP-summed views of the parameters it took over, so every variant of the norm (zero-centred
    ``1 + w``, fused or apex kernels) computes here what it computes unwrapped.
    """

    def __init__(self, norm: nn.Module, group, ledger: TPLedger | None = None,
                 sequence_parallel: bool = True):
        super().__init__()
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)
        arithmetic = copy.copy(norm)  # the parameters live here, once, under their names
        arithmetic._parameters = {}
        self.norm = arithmetic
        self.group, self.ledger = group, ledger
        self.sequence_parallel = sequence_parallel
        self.grad_group = None
        """The unit's ``hybrid.parallel.grad_groups.TPSummedGroup``, or None (one all-reduce
        per parameter)."""

    def tp_summed_params(self) -> list[str]:
        """Names of the parameters whose gradients are TP-summed."""
        return [n for n in ("weight", "bias") if getattr(self, n) is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else _summed(self, "weight")
        b = None if self.bias is None else _summed(self, "bias")
        return self.norm.normalize(x, w, b)


class SequenceParallelPositionEmbedding(nn.Module):
    """Learned positions for this rank's sequence slice: ids ``[s]`` -> ``[s/t, h]`` (rows
    ``[r s/t, (r+1) s/t)`` of ``ids``), weight replicated with a TP-summed gradient.

    Raises:
        ValueError: ``s`` not divisible by the TP size.
    """

    def __init__(self, embedding: nn.Embedding, group, ledger: TPLedger | None = None):
        super().__init__()
        self.weight = embedding.weight
        self.group, self.ledger = group, ledger
        self.rank, self.size = _group_coords(group)
        self.sequence_parallel = True
        self.grad_group = None
        """The unit's ``hybrid.parallel.grad_groups.TPSummedGroup``, or None."""

    def tp_summed_params(self) -> list[str]:
        """Names of the parameters whose gradients are TP-summed."""
        return ["weight"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[-1]
        if s % self.size:
            raise ValueError(f"sequence length {s} is not divisible by the TP size {self.size} "
                             "(sequence parallelism needs seq_length % tp == 0)")
        local = ids.narrow(-1, self.rank * (s // self.size), s // self.size)
        return F.embedding(local, _summed(self, "weight"))
