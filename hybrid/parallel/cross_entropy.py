"""Cross-entropy over vocabulary-parallel logits (Megatron-LM paper, §3).

Each TP rank holds logits for its slice of the (padded) vocabulary. The loss needs only
all-reduces of ``b*s`` values: the max (for stability), then one fused all-reduce of the
sum of exponentials, the target logit and (with label smoothing) the sum of logits. Padded
vocabulary columns are masked out of the softmax, so the loss and its gradient do not depend
on how much padding each tp adds, and padded columns get exactly zero gradient.

Label smoothing follows ``torch.nn.functional.cross_entropy``:
``loss = (1 - eps) * nll + eps * mean_j(-log p_j)`` over the ``V`` real classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, group, eps):
        # logits [..., Vl] (16-bit upcast to fp32), labels [...] int64. Every [..., Vl] pass costs
        # as much as a matmul on CPU, so the passes are counted: max, subtract, exp in place, sum,
        # divide in place. Padded columns are masked in the subtraction's own output, never in a
        # copy of the logits (which the caller may hold).
        x = logits if logits.dtype == torch.float64 else logits.float()  # 16-bit -> fp32
        vl = x.shape[-1]
        real = min(vl, max(0, vocab_size - vocab_start))  # columns [real, vl) are padding
        if real > 0:
            local_max = x[..., :real].max(dim=-1).values
        else:  # this rank holds padding only: the other ranks' max decides
            local_max = x.new_full(x.shape[:-1], float("-inf"))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - local_max.unsqueeze(-1)  # [..., Vl]
        if real < vl:
            shifted[..., real:] = float("-inf")  # exp() -> 0: no probability, no gradient

        in_range = (labels >= vocab_start) & (labels < vocab_start + vl)
        local_label = (labels - vocab_start).masked_fill(~in_range, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range,
                                                                                       0.0)
        logit_sum = shifted[..., :real].sum(dim=-1) if eps > 0 else None
        exp = shifted.exp_()
        stats = [exp.sum(dim=-1), target] + ([logit_sum] if eps > 0 else [])
        stats = torch.stack(stats)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, target = stats[0], stats[1]
        log_z = sum_exp.log()
        loss = log_z - target
        if eps > 0:
            mean_logit = stats[2] / vocab_size
            loss = (1.0 - eps) * loss + eps * (log_z - mean_logit)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, in_range)
        ctx.eps, ctx.vocab_size, ctx.real, ctx.dtype = eps, vocab_size, real, logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place, and the target columns are indexed,
        # not one-hot encoded (as in Megatron-LM): one [..., Vl] pass instead of five.
        if ctx.used:
            raise RuntimeError("vocab-parallel cross-entropy: a second backward through the same "
                               "graph (retain_graph=True) is not supported; its backward reuses "
                               "the saved softmax in place")
        ctx.used = True
        grad, local_label, in_range = ctx.saved_tensors
        rows = grad.view(-1, grad.shape[-1])
        every = torch.arange(rows.shape[0], device=rows.device)
        rows[every, local_label.reshape(-1)] -= in_range.reshape(-1).to(rows.dtype) * (1.0
                                                                                       - ctx.eps)
        if ctx.eps > 0:
            grad[..., :ctx.real].sub_(ctx.eps / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-split logits.

    Args:
        logits: ``[..., V_local]`` this rank's logits for global columns
            ``[vocab_start, vocab_start + V_local)``; columns ``>= vocab_size`` are padding.
        labels: ``[...]`` int64 target ids in ``[0, vocab_size)``.
        vocab_start: first global column held by this rank.
        vocab_size: real (unpadded) vocabulary size V.
        group: the tensor-parallel process group.
        label_smoothing: eps in ``[0, 1)``.

    Returns:
        ``[...]`` fp32 losses, identical on every rank of ``group``.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, vocab_size, group,
                                            label_smoothing)


class VocabParallelLoss(nn.Module):
    """Drop-in for ``models.gpt.LanguageModelLoss`` on vocabulary-parallel logits."""

    def __init__(self, vocab_size: int, vocab_start: int, group, label_smoothing: float = 0.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start
        self.group = group
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits, labels, self.vocab_start, self.vocab_size, self.group, self.label_smoothing
        )
