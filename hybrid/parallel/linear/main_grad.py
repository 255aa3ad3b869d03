"""The main-grad protocol between the weight-gradient GEMM and the gradient owner
(Megatron-LM's ``--gradient-accumulation-fusion``).

With 16-bit parameters and an fp32 gradient buffer (``--bf16`` without ``--grad-reduce-in-bf16``)
the weight-gradient GEMM of a tensor-parallel linear adds its fp32 result straight into the
buffer (:func:`hybrid.parallel.linear.gemm.accumulate_wgrad`) instead of handing autograd a
16-bit ``dW`` that the owner's hook would add. The handshake:

- the owner (``hybrid.zero.reduce``) sets ``p.main_grad`` (:func:`attach_main_grad`), an fp32
  view of its buffer;
- a weight-gradient GEMM that accumulates into it (:func:`fused_main_grad` says whether it may)
  sets ``p.grad_added_to_main_grad`` and returns a :func:`placeholder` for autograd, so that the
  parameter's ``AccumulateGrad`` and its post-accumulate-grad hook still run (bucket readiness
  needs them): a zero-copy 16-bit view of the main gradient's own bytes that nothing reads, or
  real zeros when the parameter has other gradient sources (``p.zero_out_wgrad``: the tied
  embedding, whose lookup gradient autograd adds to it);
- the owner's hook then drops ``p.grad`` without adding it (:func:`gradient_in_main_grad`), or
  adds it for ``zero_out_wgrad``.

A weight with a gradient hook (``Tensor.register_hook``, e.g. a test injecting an overflow) keeps
the unfused path while it has one: the hook must see, and may change, its gradient.
"""

from __future__ import annotations

import torch


def attach_main_grad(p: torch.Tensor, main: torch.Tensor) -> None:
    """Make ``main`` (fp32, ``p``'s shape) the buffer ``p``'s weight-gradient GEMMs add into."""
    p.main_grad = main
    p.grad_added_to_main_grad = False


def detach_main_grad(p: torch.Tensor) -> None:
    """Undo :func:`attach_main_grad` (the owner is closed)."""
    for name in ("main_grad", "grad_added_to_main_grad"):
        p.__dict__.pop(name, None)


def gradient_in_main_grad(p: torch.Tensor) -> bool:
    """For the gradient owner's hook: True when a GEMM accumulated ``p``'s gradient into
    ``p.main_grad`` and ``p.grad`` is a placeholder to drop; False when ``p.grad`` is to be
    added (no GEMM did, or ``p.zero_out_wgrad``: it holds the other sources' sum). Resets the
    flag for the next backward."""
    if not getattr(p, "grad_added_to_main_grad", False):
        return False
    p.grad_added_to_main_grad = False
    return not getattr(p, "zero_out_wgrad", False)


def fused_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s main grad when its weight gradient goes there (a ``main_grad`` of another
    dtype, no gradient hook on it), else None."""
    main = getattr(weight, "main_grad", None)
    if main is None or main.dtype == weight.dtype or weight._backward_hooks:
        return None
    return main


def placeholder(weight: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """What autograd receives as ``weight``'s gradient once the GEMM went into ``main``: zeros
    (``zero_out_wgrad``) or a contiguous ``weight``-dtype view of ``main``'s first bytes, which
    ``AccumulateGrad`` takes as ``p.grad`` without a copy and the owner's hook drops unread.
    Marks ``weight.grad_added_to_main_grad`` for :func:`gradient_in_main_grad`."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    flat = main.reshape(-1).view(weight.dtype)
    return flat[:weight.numel()].view(weight.shape)
