"""The one home of a tensor-parallel linear's GEMMs: how its operands are cast and multiplied.

Every TP linear (:mod:`hybrid.parallel.linear`: column, row and sequence parallel, the
shared-input pair, the rings of ``--tp-comm-overlap``, the output layer) runs its GEMMs through a
:class:`CastPolicy` taken when its forward runs (:func:`cast_policy`) and kept for its backward:

- the casts: :meth:`CastPolicy.cast_input`, :meth:`~CastPolicy.cast_weight`,
  :meth:`~CastPolicy.cast_bias` before the forward GEMM, :meth:`~CastPolicy.cast_grad` before the
  backward ones;
- the GEMMs: :meth:`~CastPolicy.forward` (``y = x W^T + b``), :meth:`~CastPolicy.dgrad`
  (``dx = dy W``), :meth:`~CastPolicy.wgrad` (``dW = dy^T x``, or accumulated into an fp32
  main gradient, below) and the rings' chunk GEMMs (:meth:`~CastPolicy.chunk_mm`, ``out=``
  forms, and :meth:`~CastPolicy.chunk_linear`); arXiv 1909.08053 §3 for their sharded forms.

Today's policy is autocast's casts made by hand: with ``torch.autocast`` on, the input, weight
and bias are cast to the autocast dtype before the GEMM, which then runs with autocast off. By
hand so that the 16-bit copies, not the fp32 tensors, are what backward keeps (as ``F.linear``
under autocast keeps them), what the sequence-parallel collectives move, and what the ``out=``
GEMMs (which autocast does not cast) read; the products are those of ``F.linear`` under
autocast, bit for bit. Without autocast the operands are used as they come. A policy for
another number format (FP8) is a subclass that overrides these methods, returned by
:func:`cast_policy`; no TP linear casts or multiplies anywhere else.

Weight-gradient accumulation (Megatron-LM's ``--gradient-accumulation-fusion``). A linear's
weight gradient is ``dW = dy^T x`` (``[out, in]`` from ``dy`` ``[tokens, out]`` and ``x``
``[tokens, in]``). With 16-bit parameters and an fp32 gradient buffer (``--bf16`` without
``--grad-reduce-in-bf16``) autograd would round ``dW`` to 16 bits, store it as ``p.grad`` and the
ZeRO engine's hook would add it into the buffer: a weight-sized 16-bit tensor written, read back,
and an extra kernel per parameter. Here the GEMM adds its fp32 accumulator into the buffer
instead, ``main += dy^T x``, with a GEMM that reads 16-bit operands and writes fp32
(:func:`accumulate_wgrad`; the handshake with the buffer's owner is
:mod:`hybrid.parallel.linear.main_grad`):

- CUDA: apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` when importable (the
  kernel Megatron-LM calls), else torch's ``addmm(..., out_dtype=torch.float32)`` into the buffer
  (cuBLAS with ``beta = 1``) when the installed torch takes an fp32 ``self`` there (probed once);
  else none, and the engine says so at start-up (:func:`wgrad_kernel`).
- CPU: torch has no 16-bit -> fp32 GEMM there; the operands are upcast to fp32 (bf16 and fp16
  values are exact in fp32, so the products are too) and ``addmm_`` accumulates in fp32: the
  same arithmetic up to the order of the sums. The copies are made for a slice of the tokens at
  a time, ``max(1, out in / (2 (out + in)))`` rows, so they hold no more bytes than the 16-bit
  ``dW`` they replace (beyond one token's row; the default dry run, on CPU, measures them).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid.parallel.linear.main_grad import fused_main_grad, placeholder

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


def weight_grad(grad2d: torch.Tensor, input2d: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """``dW = grad2d^T @ input2d`` (``[out, in]``) for autograd to accumulate, or, when
    ``weight`` (the parameter itself) has a ``main_grad`` of another dtype and no gradient hook,
    that GEMM added into it in fp32 and a placeholder returned (module docstring;
    :mod:`hybrid.parallel.linear.main_grad`). ``grad2d`` ``[tokens, out]``, ``input2d``
    ``[tokens, in]``."""
    main = fused_main_grad(weight)
    if main is None:
        return grad2d.t().matmul(input2d)
    accumulate_wgrad(main, grad2d, input2d)
    return placeholder(weight, main)


@dataclass(frozen=True)
class CastPolicy:
    """How a TP linear's operands are prepared for its GEMMs, and the GEMMs themselves (module
    docstring): autocast's casts by hand.

    Attributes:
        device_type: the device type of the forward (``"cuda"``, ``"cpu"``, ...).
        dtype: the autocast dtype the operands are cast to, or None (autocast off: operands as
            they come, every GEMM exactly the plain op).
    """

    device_type: str
    dtype: torch.dtype | None = None

    @property
    def as_they_come(self) -> bool:
        """True when the GEMMs read the operands themselves (no cast: autocast is off)."""
        return self.dtype is None

    def _cast(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.as_they_come or not t.is_floating_point():
            return t
        return t.to(self.dtype)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """The forward GEMM's input ``[..., in]`` as the GEMM reads it (and backward keeps it)."""
        return self._cast(x)

    def cast_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight ``[out, in]`` as the GEMMs read it (and backward keeps it)."""
        return self._cast(weight)

    def cast_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The bias ``[out]`` (or None) as the forward GEMM adds it."""
        return self._cast(bias)

    def cast_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The output gradient ``[..., out]`` in the dtype of the (cast) ``weight``, for the
        backward GEMMs."""
        return grad.to(weight.dtype)

    def _gemm(self):
        """The context of a GEMM on cast operands: autocast off when the casts were made here."""
        if self.as_they_come:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, enabled=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b``: ``[..., in]`` -> ``[..., out]`` (``F.linear``)."""
        with self._gemm():
            return F.linear(x, weight, bias)

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The input gradient ``dy W``: ``[..., out]`` -> ``[..., in]``."""
        with self._gemm():
            return grad.matmul(weight)

    def wgrad(self, grad2d: torch.Tensor, input2d: torch.Tensor,
              weight: torch.Tensor) -> torch.Tensor:
        """The weight gradient ``dy^T x`` (``[out, in]``) of ``grad2d`` ``[tokens, out]`` and
        ``input2d`` ``[tokens, in]``, or its placeholder once accumulated into ``weight``'s main
        grad (:func:`weight_grad`)."""
        with self._gemm():
            return weight_grad(grad2d, input2d, weight)

    def chunk_mm(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor) -> torch.Tensor:
        """``out = a @ b (+ bias)`` in place: one ring chunk's GEMM, ``a`` ``[rows, k]``, ``b``
        ``[k, n]``, ``out`` ``[rows, n]`` (a view of the ring's output)."""
        with self._gemm():
            if bias is None:
                return torch.mm(a, b, out=out)
            return torch.addmm(bias, a, b, out=out)

    def chunk_linear(self, chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``chunk W^T`` without bias: ``[..., in]`` -> ``[..., out]``, for a chunk that is a
        strided view of the layer's input (the reduce-scatter ring's partial sums)."""
        with self._gemm():
            return torch.matmul(chunk, weight.t())


def cast_policy(device: torch.device) -> CastPolicy:
    """The :class:`CastPolicy` of a forward running now on ``device``: the autocast dtype when
    autocast is on there, else none (and none on a device without autocast, e.g. ``meta``)."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return CastPolicy(kind)
    return CastPolicy(kind, torch.get_autocast_dtype(kind))


class _Linear(torch.autograd.Function):
    """``F.linear`` whose weight gradient goes through :func:`weight_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias, policy):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.policy = bias is not None, policy
        return policy.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = ctx.policy.dgrad(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = (ctx.policy.wgrad(g2, x.reshape(-1, x.shape[-1]), weight)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, g2.sum(0) if ctx.has_bias else None, None


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """A TP linear's GEMM without a collective (the row-parallel product, any linear at one
    rank): ``[..., in]`` -> ``[..., out]``, autograd's own ``F.linear`` on the
    :func:`cast_policy`'s operands; when they are the parameters themselves and ``weight`` has
    a ``main_grad`` of another dtype (and no gradient hook), an autograd function whose weight
    gradient accumulates into it (:func:`weight_grad`). Without autocast or a main grad it is
    ``F.linear`` itself, bit for bit."""
    policy = cast_policy(x.device)
    if policy.as_they_come and fused_main_grad(weight) is not None:
        return _Linear.apply(x, weight, bias, policy)
    return policy.forward(policy.cast_input(x), policy.cast_weight(weight),
                          policy.cast_bias(bias))
