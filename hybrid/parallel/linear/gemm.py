"""The weight-gradient GEMM of the tensor-parallel linears, accumulated straight into an fp32
main gradient (Megatron-LM's ``--gradient-accumulation-fusion``).

A linear ``y = x W^T`` has the weight gradient ``dW = dy^T x`` (``[out, in]`` from ``dy``
``[tokens, out]`` and ``x`` ``[tokens, in]``; arXiv 1909.08053 §3 for its sharded forms). With
16-bit parameters and an fp32 gradient buffer (``--bf16`` without ``--grad-reduce-in-bf16``)
autograd would round ``dW`` to 16 bits, store it as ``p.grad`` and the ZeRO engine's hook would
add it into the buffer: a weight-sized 16-bit tensor written, read back, and an extra kernel per
parameter. Here the GEMM adds its fp32 accumulator into the buffer instead, ``main += dy^T x``,
with a GEMM that reads 16-bit operands and writes fp32 (:func:`accumulate_wgrad`):

- CUDA: apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` when importable (the
  kernel Megatron-LM calls), else torch's ``addmm(..., out_dtype=torch.float32)`` into the buffer
  (cuBLAS with ``beta = 1``) when the installed torch takes an fp32 ``self`` there (probed once);
  else none, and the engine says so at start-up (:func:`wgrad_kernel`).
- CPU: torch has no 16-bit -> fp32 GEMM there; the operands are upcast to fp32 (bf16 and fp16
  values are exact in fp32, so the products are too) and ``addmm_`` accumulates in fp32: the
  same arithmetic up to the order of the sums. The copies are made for a slice of the tokens at
  a time, ``max(1, out in / (2 (out + in)))`` rows, so they hold no more bytes than the 16-bit
  ``dW`` they replace (beyond one token's row; the default dry run, on CPU, measures them).

The protocol with the gradient owner (``hybrid.zero.reduce``), Megatron-LM's: the owner sets
``p.main_grad`` (:func:`attach_main_grad`), an fp32 view of its buffer; a wgrad site that
accumulates into it sets ``p.grad_added_to_main_grad`` and returns a placeholder for autograd,
so that the parameter's ``AccumulateGrad`` and its post-accumulate-grad hook still run (bucket
readiness needs them): a zero-copy 16-bit view of the main gradient's own bytes that nothing
reads, or real zeros when the parameter has other gradient sources (``p.zero_out_wgrad``: the
tied embedding, whose lookup gradient autograd adds to it). The owner's hook then drops
``p.grad`` without adding it (:func:`gradient_in_main_grad`), or adds it for ``zero_out_wgrad``.

Every wgrad site calls :func:`weight_grad` (the custom TP autograd functions) or :func:`linear`
(where a plain ``F.linear`` ran). A weight with a gradient hook (``Tensor.register_hook``, e.g. a
test injecting an overflow) keeps the unfused path while it has one: the hook must see, and may
change, its gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

APEX_KERNEL = "apex fused_weight_gradient_mlp_cuda"
TORCH_KERNEL = "torch addmm out_dtype=float32"
CPU_KERNEL = "fp32 addmm of the upcast operands"


@functools.cache
def _wgrad_kernel(device_type: str) -> tuple[str | None, str]:
    if device_type != "cuda":
        return CPU_KERNEL, ""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
        return APEX_KERNEL, ""
    except ImportError:
        pass
    try:  # a 16-bit GEMM accumulating into an fp32 "self" in place (cuBLAS beta = 1)
        c = torch.zeros(8, 8, device="cuda")
        a = torch.ones(8, 8, dtype=torch.bfloat16, device="cuda")
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError, NotImplementedError, AssertionError) as e:
        return None, (f"torch {torch.__version__} has no 16-bit GEMM that accumulates into an "
                      f"fp32 buffer on CUDA ({str(e).splitlines()[0][:80]}) and apex's "
                      "fused_weight_gradient_mlp_cuda is not installed")
    return TORCH_KERNEL, ""


def wgrad_kernel(device: torch.device | str) -> tuple[str | None, str]:
    """``(kernel, why_none)``: the fp32-accumulating weight-gradient GEMM on ``device`` (one of
    :data:`APEX_KERNEL`, :data:`TORCH_KERNEL`, :data:`CPU_KERNEL`), or ``(None, the reason)``.
    Probed once per device type (one 8 x 8 GEMM on CUDA)."""
    return _wgrad_kernel(torch.device(device).type)


def accumulate_wgrad(main: torch.Tensor, grad2d: torch.Tensor, input2d: torch.Tensor) -> None:
    """``main += grad2d^T @ input2d`` in fp32: ``main`` ``[out, in]`` fp32, ``grad2d``
    ``[tokens, out]``, ``input2d`` ``[tokens, in]`` (16-bit or fp32). See the module docstring
    for the kernel per device."""
    same = grad2d.dtype == input2d.dtype and grad2d.dtype in (torch.bfloat16, torch.float16)
    kernel = wgrad_kernel(main.device)[0] if same else CPU_KERNEL
    if kernel == APEX_KERNEL:
        import fused_weight_gradient_mlp_cuda

        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(
            input2d.contiguous(), grad2d.contiguous(), main)
    elif kernel == TORCH_KERNEL:
        torch.addmm(main, grad2d.t(), input2d, out_dtype=torch.float32, out=main)
    else:  # fp32 copies of `rows` tokens at a time: about the bytes of a 16-bit dW
        out, inp = main.shape
        rows = max(1, out * inp // (2 * (out + inp)))
        for a in range(0, grad2d.shape[0], rows):
            main.addmm_(grad2d[a:a + rows].t().float(), input2d[a:a + rows].float())


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


def _placeholder(weight: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """What autograd receives as ``weight``'s gradient once the GEMM went into ``main``: zeros
    (``zero_out_wgrad``) or a contiguous ``weight``-dtype view of ``main``'s first bytes, which
    ``AccumulateGrad`` takes as ``p.grad`` without a copy and the owner's hook drops unread."""
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    flat = main.reshape(-1).view(weight.dtype)
    return flat[:weight.numel()].view(weight.shape)


def _fused(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s main grad when its weight gradient goes there (a ``main_grad`` of another
    dtype, no gradient hook on it), else None."""
    main = getattr(weight, "main_grad", None)
    if main is None or main.dtype == weight.dtype or weight._backward_hooks:
        return None
    return main


def weight_grad(grad2d: torch.Tensor, input2d: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """``dW = grad2d^T @ input2d`` (``[out, in]``) for autograd to accumulate, or, when
    ``weight`` (the parameter itself) has a ``main_grad`` of another dtype and no gradient hook,
    that GEMM added into it in fp32 and a placeholder returned (module docstring). ``grad2d``
    ``[tokens, out]``, ``input2d`` ``[tokens, in]``."""
    main = _fused(weight)
    if main is None:
        return grad2d.t().matmul(input2d)
    accumulate_wgrad(main, grad2d, input2d)
    weight.grad_added_to_main_grad = True
    return _placeholder(weight, main)


class _Linear(torch.autograd.Function):
    """``F.linear`` whose weight gradient goes through :func:`weight_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = (weight_grad(g2, x.reshape(-1, x.shape[-1]), weight)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, g2.sum(0) if ctx.has_bias else None


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``[..., in]`` -> ``[..., out]``); when ``weight`` has a
    ``main_grad`` of another dtype (and no gradient hook, no autocast is on), an autograd function
    whose weight gradient accumulates into it (:func:`weight_grad`). Otherwise it is
    ``F.linear`` itself, bit for bit."""
    if _fused(weight) is None or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)
