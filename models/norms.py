"""The model's norm modules (LayerNorm, RMSNorm and their zero-centred ``1P`` variants), their
shared arithmetic (:class:`NormArithmetic`), and RMSNorm with the saved-for-backward footprint of
a fused kernel.

Autograd through torch's composite RMSNorm keeps more than the math needs: ``nn.RMSNorm`` on a
16-bit input saves the fp32 upcast and the fp32 normalised input (two ``[s, b, h]`` fp32
tensors, 8x a bf16 input). :func:`rms_norm` saves what Megatron-LM's fused RMSNorm (Apex /
Transformer Engine) saves, the input and the per-token ``1 / rms`` (fp32), like
``F.layer_norm``, and recomputes the rest in backward. It computes in fp32 (float64 stays
float64) and returns the input dtype, so fp32 results equal the composite form's up to rounding
(checked by ``tests/test_llama_model.py``). SwiGLU's counterpart is :mod:`models.swiglu`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models import fusion
from models.fusion import OFF, KernelFusion


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is when wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd
        if weight is not None:
            y = y * _wide(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = _wide(x) * rstd
        g = _wide(grad)
        grad_w = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_w = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype)
            g = g * _wide(weight)
        grad_x = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (Zhang & Sennrich 2019,
    arXiv 1910.07467 Eq. 4), computed in fp32; ``x`` ``[..., n]``, ``weight`` ``[n]``. Saves
    ``x`` and the fp32 ``[..., 1]`` reciprocal rms for backward."""
    return _RMSNorm.apply(x, weight, eps)


class NormArithmetic:
    """What every norm module of the model shares: its arithmetic on given parameters.

    :meth:`normalize` is the one place a norm's formula lives. ``forward`` applies it to the
    module's own parameters; a wrapper that substitutes them (``hybrid``'s sequence-parallel norm,
    whose weight reaches the formula through a TP-summed view) calls :meth:`normalize` of the
    module it wraps, so variants such as the zero-centred ``1 + w`` scale
    (:meth:`effective_weight`) are never restated elsewhere.
    """

    fusion: KernelFusion = OFF
    """:class:`models.fusion.KernelFusion`; ``norm`` runs the fused kernel."""
    fused_kernel = None
    """A fused norm kernel ``(x, weight, bias, eps) -> y`` to run instead of the compiled one
    when ``fusion.norm`` is set (apex's, installed by ``hybrid`` on CUDA), or None."""

    def fused_chains(self) -> tuple[str, ...]:
        """The :class:`models.fusion.KernelFusion` fields this module reads."""
        return ("norm",)

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The scale the formula multiplies by, from the stored ``weight`` ``[n]``: the weight
        itself here; ``1 + weight`` for the zero-centred variants."""
        return weight

    def normalize(self, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """This norm of ``x`` ``[..., n]`` with the stored parameters ``weight`` (and ``bias``)
        ``[n]`` given explicitly; output ``[..., n]`` in ``x``'s dtype."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight, getattr(self, "bias", None))


class RMSNorm(NormArithmetic, nn.Module):
    """``nn.RMSNorm``'s interface (``normalized_shape``, ``eps``, ``weight`` of ones) over
    :func:`rms_norm`. Input/output ``[..., size]``; no bias."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape, self.eps = (size,), eps
        self.weight = nn.Parameter(torch.ones(size))
        self.fusion = OFF

    def normalize(self, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x / rms(x) * effective_weight(weight)`` (arXiv 1910.07467 Eq. 4); ``bias`` must be
        None (an RMSNorm has none)."""
        w = self.effective_weight(weight)
        if self.fusion.norm:
            if self.fused_kernel is not None:
                return self.fused_kernel(x, w, None, self.eps)
            return fusion.rms_norm(x, w, self.eps)
        return rms_norm(x, w, self.eps)


class LayerNorm(NormArithmetic, nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and names) that runs the compiled kernel when its
    ``fusion.norm`` is set (:mod:`models.fusion`); otherwise exactly ``nn.LayerNorm``."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__(size, eps=eps)
        self.fusion = OFF

    def normalize(self, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """``(x - mean) / std * effective_weight(weight) + bias`` over the last dimension
        (arXiv 1607.06450 §3.1)."""
        w = self.effective_weight(weight)
        if self.fusion.norm:
            if self.fused_kernel is not None:
                return self.fused_kernel(x, w, bias, self.eps)
            return fusion.layer_norm(x, w, bias, self.eps)
        return nn.functional.layer_norm(x, self.normalized_shape, w, bias, self.eps)


class RMSNorm1P(RMSNorm):
    """:class:`RMSNorm` scaled by ``1 + weight``, the weight starting at 0 (Megatron-LM's
    ``--apply-layernorm-1p``: zero-centred gamma, so weight decay pulls the scale towards 1)."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``1 + weight``."""
        return weight + 1


class LayerNorm1P(LayerNorm):
    """``nn.LayerNorm`` scaled by ``1 + weight``, the weight starting at 0
    (``--apply-layernorm-1p``, as Megatron-LM's ``FusedLayerNorm`` with ``zero_centered_gamma``)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``1 + weight``."""
        return weight + 1
