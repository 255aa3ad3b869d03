"""The tensor-parallel plan's styles: how each kind of module is swapped for its TP form.

:data:`STYLES` maps a style name, as the plans of :mod:`hybrid.parallel.tp_plan` name it, to a
callable ``(module, swap) -> replacement`` (the layers are :mod:`hybrid.parallel.layers`' and
:mod:`hybrid.parallel.linear.modules`'):
``vocab_embedding``, ``vocab_output`` (the untied head), ``column``, ``row`` (and their
``column_token_wise`` / ``row_token_wise`` forms for the MLP), ``tp_dropout``,
``parallel_output``, ``vocab_parallel_loss``, ``tp_summed_norm`` (the per-head q/k norms) and,
with sequence parallelism, ``sp_layernorm`` and ``sp_positions``. :class:`Swap` carries what
they need besides the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybrid.parallel.cross_entropy import VocabParallelLoss
from hybrid.parallel.layers import (
    ParallelOutputLayer,
    SequenceParallelLayerNorm,
    SequenceParallelPositionEmbedding,
    TPRegionDropout,
    VocabParallelEmbedding,
)
from hybrid.parallel.linear.modules import ColumnParallelLinear, RowParallelLinear
from hybrid.parallel.ops import TPLedger
from hybrid.parallel.rng import RNGTracker
from models.gpt import GPT


@dataclass(frozen=True)
class Swap:
    """What a style needs besides the module it replaces (one per
    :func:`hybrid.parallel.tp_plan.parallelize_gpt`)."""

    model: GPT
    tp_group: object
    tracker: RNGTracker | None
    vocab_pad: int
    ledger: TPLedger
    sequence_parallel: bool
    device: torch.device
    dtype: torch.dtype
    tp_comm_overlap: bool = False
    """Pipeline the block linears' SP collectives with their GEMMs
    (``hybrid.parallel.linear.collective_matmul``; given to each linear at construction)."""

    @property
    def kw(self) -> dict:
        return dict(device=self.device, dtype=self.dtype)

    @property
    def sp(self) -> dict:
        return dict(sequence_parallel=self.sequence_parallel, ledger=self.ledger)


def _vocab_embedding(module: nn.Module, s: Swap) -> nn.Module:
    cfg = s.model.config
    layer = VocabParallelEmbedding(cfg.vocab_size, s.vocab_pad, cfg.hidden_size, s.tp_group,
                                   **s.kw, **s.sp)
    if s.model.lm_head is None:  # tied: the output layer's GEMM is its second gradient source,
        layer.weight.zero_out_wgrad = True  # so a fused GEMM's placeholder must be zeros
    return layer


def _vocab_output(module: nn.Module, s: Swap) -> nn.Module:
    # the untied head's input is gathered by the output layer, not by this weight's owner
    cfg = s.model.config
    return ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, s.tp_group, bias=False,
                                padded_out=s.vocab_pad, **s.kw, ledger=s.ledger)


def _column(module: nn.Linear, s: Swap, token_wise: bool = False) -> nn.Module:
    return ColumnParallelLinear(module.in_features, module.out_features, s.tp_group,
                                bias=module.bias is not None, **s.kw, **s.sp,
                                token_wise=token_wise, tp_comm_overlap=s.tp_comm_overlap)


def _row(module: nn.Linear, s: Swap, token_wise: bool = False) -> nn.Module:
    return RowParallelLinear(module.in_features, module.out_features, s.tp_group,
                             bias=module.bias is not None, **s.kw, **s.sp,
                             token_wise=token_wise, tp_comm_overlap=s.tp_comm_overlap)


def _vocab_parallel_loss(module: nn.Module, s: Swap) -> nn.Module:
    # ``wte`` comes first in ``named_modules()``, so it is already vocab-parallel here
    cfg = s.model.config
    return VocabParallelLoss(cfg.vocab_size, s.model.wte.vocab_start, s.tp_group,
                             cfg.label_smoothing)


STYLES: dict[str, Callable[[nn.Module, Swap], nn.Module]] = {
    "vocab_embedding": _vocab_embedding,
    "vocab_output": _vocab_output,
    "column": _column,
    "row": _row,
    "column_token_wise": lambda module, s: _column(module, s, token_wise=True),
    "row_token_wise": lambda module, s: _row(module, s, token_wise=True),
    "tp_dropout": lambda module, s: TPRegionDropout(module.p, s.tracker),
    "sp_layernorm": lambda module, s: SequenceParallelLayerNorm(module, s.tp_group, s.ledger),
    "tp_summed_norm": lambda module, s: SequenceParallelLayerNorm(module, s.tp_group, s.ledger,
                                                                  sequence_parallel=False),
    "sp_positions": lambda module, s: SequenceParallelPositionEmbedding(
        module, s.tp_group, s.ledger),
    "parallel_output": lambda module, s: ParallelOutputLayer(s.tp_group, **s.sp),
    "vocab_parallel_loss": _vocab_parallel_loss,
}
"""Style name (the values of ``tp_plan``'s plans) -> ``(module, swap) -> its TP replacement``."""
