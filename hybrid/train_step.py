"""One optimizer step over a rank's micro-batches: Megatron-LM's loss weighting (a loss mask,
``--calculate-per-token-loss``), the logged ``lm loss``, the NaN guard and the engine's step.
:mod:`hybrid.training` runs it in its loop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybrid.zero.grad_norm import host_values
from hybrid.zero.profile import NULL_TIMER

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.zero.engine import ZeroEngine


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    nan_loss: bool


def _dp_mean(values: torch.Tensor, group, dp: int) -> torch.Tensor:
    if dp > 1:
        dist.all_reduce(values, group=group)
    return values / dp


Batch = "torch.Tensor | dict"
"""A micro-batch: ``[b, s+1]`` int64 token ids, or ``{"tokens": [b, s+1], "loss_mask": [b, s]
(float, 1 where a label counts: Megatron-LM's loss mask) or None, "documents":
models.documents.Documents or None}``."""


def _tokens_and_mask(batch, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens, mask, _ = unpack(batch, device)
    return tokens, mask


def unpack(batch, device) -> tuple:
    """``(tokens, loss_mask or None, documents or None)`` of a :data:`Batch`, on ``device``."""
    if not isinstance(batch, dict):
        return batch.to(device, non_blocking=True), None, None
    mask, docs = batch.get("loss_mask"), batch.get("documents")
    return (batch["tokens"].to(device, non_blocking=True),
            None if mask is None else mask.to(device, non_blocking=True),
            None if docs is None else docs.to(device, non_blocking=True))


def per_label_losses(model, tokens: torch.Tensor, documents) -> torch.Tensor:
    """``[b, s]`` losses of ``tokens`` ``[b, s+1]`` (packed ``documents`` when given)."""
    if documents is None:
        return model(tokens[:, :-1], tokens[:, 1:])
    return model(tokens[:, :-1], tokens[:, 1:], documents=documents)


def _token_counts(micro_batches: list, grid: ProcessGrid, per_token: bool) -> torch.Tensor | None:
    """The unmasked labels of the global batch (summed over micro-batches and data-parallel
    ranks; one all-reduce) when ``per_token`` (``--calculate-per-token-loss``); else None. Known
    before any forward: the loss mask depends on the tokens only."""
    if not per_token:
        return None
    count = torch.zeros(1, dtype=torch.float64, device=grid.device)
    for b in micro_batches:
        tokens, mask = _tokens_and_mask(b, grid.device)
        count += mask.sum() if mask is not None else tokens[:, 1:].numel()
    if grid.dp_size > 1:
        dist.all_reduce(count, group=grid.dp_group)
    return count


def train_step(engine: ZeroEngine, micro_batches: list, lr: float, grid: ProcessGrid,
               weight_decay: float | None = None, decoupled_lr: float | None = None,
               per_token: bool = False) -> StepResult:
    """One optimizer step over this rank's micro-batches (:data:`Batch`), with learning rate
    ``lr`` (``decoupled_lr`` for the embedding and output weights, None: ``lr``) and the decayed
    parameters' ``weight_decay`` (None: unchanged).

    As Megatron-LM's schedule (``forward_step``): each micro-batch's loss is its masked sum over
    its unmasked labels (clamped at 1), divided by the number of micro-batches, and the
    data-parallel reduction averages; with ``per_token`` (``--calculate-per-token-loss``) it is
    the masked sum over the unmasked labels of the whole global batch (every micro-batch and
    data-parallel rank), so every token weighs the same. The logged loss is the data-parallel
    mean of the per-micro-batch means without a loss mask, and the global batch's masked sum over
    its unmasked-label count with one (Megatron-LM's ``lm loss``). A NaN/inf loss discards the
    gradients instead of stepping.
    """
    n = len(micro_batches)
    total = _token_counts(micro_batches, grid, per_token)
    losses = torch.zeros(n, dtype=torch.float64, device=grid.device)  # no host sync per micro-batch
    sums = torch.zeros(2, dtype=torch.float64, device=grid.device)  # masked sum, unmasked count
    masked = False
    for i, batch in enumerate(micro_batches):
        tokens, mask, docs = unpack(batch, grid.device)
        with getattr(engine, "timer", NULL_TIMER).phase("forward"):
            per_label = per_label_losses(engine.model, tokens, docs)
            if mask is None:
                loss, loss_sum = per_label.mean(), per_label.sum()
            else:
                masked = True
                loss_sum, count = (per_label.float() * mask).sum(), mask.sum()
                loss = loss_sum / torch.clamp(count, min=1)
                sums += torch.stack([loss_sum.detach(), count]).double()
        if per_token:  # the data-parallel reduction averages: dp / N makes it sum / N
            scaled = loss_sum * (grid.dp_size / total[0]).to(loss_sum.dtype)
        else:
            scaled = loss / n
        engine.backward(scaled, is_last_micro_batch=i == n - 1)
        losses[i] = loss.detach()
    mean = host_values(_logged_loss(losses, sums, masked, grid))[0]
    if not math.isfinite(mean):
        engine.zero_grad()
        return StepResult(mean, float("nan"), engine.loss_scale, True, True)
    info = (engine.step(lr, weight_decay) if decoupled_lr is None
            else engine.step(lr, weight_decay, decoupled_lr))
    return StepResult(mean, info.grad_norm, info.loss_scale, info.skipped, False)


def _logged_loss(losses: torch.Tensor, sums: torch.Tensor, masked: bool,
                 grid: ProcessGrid) -> torch.Tensor:
    """``[1]``: the mean of the micro-batch means over dp (no loss mask: every micro-batch has
    as many labels), else the global masked sum over the global unmasked count."""
    if not masked:
        return _dp_mean(losses.mean().reshape(1), grid.dp_group, grid.dp_size)
    if grid.dp_size > 1:
        dist.all_reduce(sums, group=grid.dp_group)
    return (sums[0] / sums[1]).reshape(1)
