"""The tensor-parallel layers around the linears (Megatron-LM paper, §3): the vocab-parallel
embedding, the output layer, dropout inside a TP region, and the sequence-parallel norm and
positions (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2). The column- and row-parallel
linears are :mod:`hybrid.parallel.linear`.

With ``sequence_parallel=True`` the activations between tensor-parallel regions (LayerNorms,
dropouts, residuals) are ``[b, s/t, h]`` on each rank: a column-parallel layer all-gathers its
input along the sequence (and keeps only the slice for backward), a row-parallel layer
reduce-scatters its output, the vocab-parallel embedding reduce-scatters its lookup and the
output layer all-gathers the final LayerNorm's output. Replicated parameters used on a slice
(LayerNorms, row-parallel biases, positions) get their gradient all-reduced over the TP group
in backward (:func:`hybrid.parallel.grad_groups.tp_summed`), so ``param.grad`` is the full
gradient on every TP rank before any ZeRO reduction sees it.

Each layer gives its parameters their :class:`hybrid.parallel.tp_spec.TPSpec`.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel.grad_groups import summed_param
from hybrid.parallel.linear.functions import column_parallel_linear, sequence_parallel_linear
from hybrid.parallel.ops import TPLedger, reduce_from_tp, reduce_scatter_sequence
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_spec import TPSpec, set_tp_spec


def _group_coords(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


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
    """Local logits ``[b, s, V_padded / tp] = h @ W_i.T`` from replicated hidden ``[b, s, h]``:
    a column-parallel linear (:mod:`hybrid.parallel.linear.functions`) on the vocabulary-split
    weight it is given (the tied embedding's or the untied head's).

    The logits stay split: the vocab-parallel loss consumes them with all-reduces of ``b*s``
    values instead of gathering ``b*s*V`` logits (Megatron-LM §3). With ``sequence_parallel``
    the hidden input is this rank's ``[b, s/t, h]`` and is all-gathered along the sequence.
    """

    def __init__(self, group, sequence_parallel: bool = False, ledger: TPLedger | None = None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.ledger = ledger
        self._forward = sequence_parallel_linear if sequence_parallel else column_parallel_linear

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._forward(hidden, weight, None, self.group, self.ledger)


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


class SequenceParallelLayerNorm(nn.Module):
    """A LayerNorm or RMSNorm whose replicated weight (and bias) — the same Parameter objects as
    the module it replaces — get TP-summed gradients
    (:func:`hybrid.parallel.grad_groups.tp_summed`).

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
        w = None if self.weight is None else summed_param(self, "weight")
        b = None if self.bias is None else summed_param(self, "bias")
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
        return F.embedding(local, summed_param(self, "weight"))
