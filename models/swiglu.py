"""SwiGLU with the saved-for-backward footprint of a fused kernel.

Autograd through the composite ``silu(gate) * up`` saves the gate, the SiLU output and the up
projection. :func:`swiglu` saves what Megatron-LM's fused ``bias_swiglu`` saves, ``gate`` and
``up`` only, and recomputes SiLU in backward. It computes in fp32 (float64 stays float64) and
returns the input dtype, so fp32 results equal the composite form's up to rounding (checked by
``tests/test_llama_model.py``). The norms' counterpart is :func:`models.norms.rms_norm`.
"""

from __future__ import annotations

import torch


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is when wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return (torch.nn.functional.silu(_wide(gate)) * _wide(up)).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        g, a, u = _wide(grad), _wide(gate), _wide(up)
        sig = torch.sigmoid(a)
        silu = a * sig
        grad_gate = g * u * sig * (1 + a * (1 - sig))  # d silu(a) / da = s (1 + a (1 - s))
        return grad_gate.to(gate.dtype), (g * silu).to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Shazeer 2020, arXiv 2002.05202 Eq. 6), computed in fp32; both
    ``[..., f]``. Saves only ``gate`` and ``up`` for backward (SiLU is recomputed)."""
    return _SwiGLU.apply(gate, up)
