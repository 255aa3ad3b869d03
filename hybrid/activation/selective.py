"""Selective activation recompute (Korthikanti et al. 2022, arXiv 2205.05198, §5).

Only the attention core, ``dropout(softmax(q k^T / sqrt(d) + mask)) v``, is recomputed in
backward: it holds the ``5as^2b/t`` bytes of Table 2 (softmax output, its dropout mask and the
dropout output) for few FLOPs. Everything else of the layer is kept, so a layer stores
``sbh(10 + 24/t)`` bytes under TP and ``34 sbh / t`` with sequence parallelism (16-bit
activations, 1-byte masks).

The core's inputs ``q, k, v`` are views of the ``qkv`` output, which the layer keeps anyway;
saving them adds no memory. The RNG states at the forward (the default generators and the TP
stream of the dropout) are restored for the recompute, so the dropout mask is the same.

On the fused attention kernel (``models.blocks.Attention.core``: the default on GPU, with or
without dropout) the core keeps no ``s^2`` tensor, so selective recompute has nothing to
recompute there: it saves only the core's output and log-sum-exp for a second attention forward.
The ``5as^2b/t`` it removes are the explicit core's (CPU's default with dropout).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.activation.recompute import autocast_state, replaying_forward
from hybrid.parallel.rng import capture_torch_rng


class _CoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wrapper: SelectiveCore, q, k, v):
        store = wrapper.store
        ctx.wrapper = wrapper
        ctx.rng = capture_torch_rng(store.tracker, q.device)
        ctx.autocast = autocast_state(q.device)
        with torch.no_grad():
            out = wrapper.original(q, k, v)
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        wrapper: SelectiveCore = ctx.wrapper
        store = wrapper.store
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with replaying_forward(store, ctx.rng, ctx.autocast, inputs[0].device):
            out = wrapper.original(*inputs)
        store.stats.selective_recomputes += 1
        grads = torch.autograd.grad(out, inputs, grad_out)
        return (None, *grads)


class SelectiveCore:
    """Replaces ``attn.core`` (an instance attribute; the module tree does not change) with a
    version that keeps only ``q, k, v`` ``[b, heads/t, s, d]`` and recomputes the core in backward.

    Args:
        attn: a ``models.gpt.Attention`` (or any module with ``core(q, k, v)``).
        store: the :class:`hybrid.activation.recompute.ActivationStore` (tracker, meter, counters).
    """

    def __init__(self, attn: nn.Module, store):
        self.attn = attn
        self.store = store
        self.replaced = attn.__dict__.get("core")
        self.original = self.replaced or attn.core

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad
                                               or v.requires_grad):
            return self.original(q, k, v)
        return _CoreFunction.apply(self, q, k, v)

    def remove(self) -> None:
        """Put back the core that was there before."""
        if self.attn.__dict__.get("core") is self:
            del self.attn.core
            if self.replaced is not None:
                self.attn.core = self.replaced
