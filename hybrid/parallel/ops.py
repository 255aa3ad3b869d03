"""Conjugate autograd collectives of tensor parallelism (Megatron-LM paper, §3, Figure 3).

- :func:`copy_to_tp` ("f"): identity forward, all-reduce of the gradient backward. Enters a
  column-parallel region.
- :func:`reduce_from_tp` ("g"): all-reduce forward, identity backward. Leaves a row-parallel
  region.
- :func:`all_gather_flat`: the one flat all-gather (no autograd) that ZeRO's ledger and the
  partitioned activation checkpoints both use.

The autograd ops are no-ops when the group has one rank. Tensors may have any shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward ("f")."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward ("g")."""
    return _ReduceFromTP.apply(x, group)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """All-gather ``inp`` (``[n]``) from every rank of ``group`` into ``out`` (``[world * n]``, rank order).

    ``torch.distributed.all_gather_single`` replaces ``all_gather_into_tensor`` in recent torch;
    it is looked up at call time so that tests can count calls by patching ``torch.distributed``.
    Returns the work handle with ``async_op``, else None.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)
