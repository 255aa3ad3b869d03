"""Fused elementwise kernels, as Megatron-Core fuses them: ``torch.compile``d regions.

Megatron-Core fuses the elementwise chains around its GEMMs with Transformer Engine / apex
kernels and with ``jit_fuser`` (``torch.compile``) functions: the norms, bias-GeLU, bias-SwiGLU,
bias-dropout-add and RoPE. The same chains here are plain functions compiled one region each
(``fullgraph=True``: a graph break is an error, not a silent split; ``dynamic=False``: one
specialisation per shape, as a training run has one shape). Each is what the eager model
computes, so a fused model trains the same function; results differ from the eager path by
rounding (the compiled kernels keep intermediates in registers and reorder sums) and, with
dropout, by the masks (inductor draws them from a seed it takes from the default generator,
not elementwise as ATen's ``bernoulli_``).

Dropout masks and replay: a compiled region takes its random seed from the device's default
generator when it runs, so the generator state at the call decides the mask. Activation
recompute restores the default generator and the TP stream (``hybrid.parallel.rng``) before
re-running a block, and the TP-region dropout makes its stream the default generator around the
call (:func:`models.blocks.dropout_rng_scope`): both replay the same masks
(``tests/test_kernel_fusion.py``).

:class:`KernelFusion` says which chains are fused; every module with a ``fusion`` attribute
reads it (:func:`set_kernel_fusion`). The default, all off, is the eager path bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.rope import apply_rotary


@dataclass(frozen=True)
class KernelFusion:
    """Which elementwise chains run as compiled regions (Megatron-LM's fusion flags)."""

    norm: bool = False
    """LayerNorm / RMSNorm (apex's kernels when ``hybrid.fusion`` finds them)."""
    bias_gelu: bool = False
    """``gelu(y + b)`` after the MLP's first linear (``--no-bias-gelu-fusion``)."""
    bias_swiglu: bool = False
    """``silu(gate + b_g) * (up + b_u)`` (``--no-bias-swiglu-fusion``)."""
    bias_dropout: bool = False
    """``residual + dropout(y + b)`` after attention and MLP (``--no-bias-dropout-fusion``)."""
    rope: bool = False
    """RoPE on q and k together (``--no-rope-fusion``)."""

    @classmethod
    def every(cls, on: bool = True) -> KernelFusion:
        """Every chain fused (``on``) or none."""
        return cls(**{f.name: on for f in fields(cls)})

    def names(self, model: nn.Module | None = None) -> list[str]:
        """The fused chains' names, in declaration order; with ``model``, only the chains that
        some module of ``model`` runs (:func:`chains_in`: a GPT has no SwiGLU or RoPE)."""
        used = None if model is None else chains_in(model)
        return [f.name for f in fields(self) if getattr(self, f.name)
                and (used is None or f.name in used)]


OFF = KernelFusion()
"""No fusion: the eager path (immutable, shared as every module's default)."""


def chains_in(model: nn.Module) -> set[str]:
    """The :class:`KernelFusion` fields that some module of ``model`` reads: each fusable
    module's ``fused_chains()`` (a norm: ``norm``; an MLP: ``bias_swiglu`` or ``bias_gelu``;
    attention: ``rope`` when rotary; a block: ``bias_dropout``)."""
    return {c for m in model.modules() if hasattr(m, "fused_chains") for c in m.fused_chains()}


def set_kernel_fusion(model: nn.Module, fusion: KernelFusion) -> int:
    """Set ``fusion`` on every module of ``model`` that has a ``fusion`` attribute.

    Returns:
        The number of modules set.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "fusion"):
            module.fusion = fusion
            n += 1
    return n


@functools.cache
def _compiled(fn):
    """``fn`` compiled once per process (lazily: importing dynamo costs seconds, which a run
    without fusion should not pay)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rms_norm(x, weight, eps: float):
    xf = _wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * _wide(weight)).to(x.dtype)


def _layer_norm(x, weight, bias, eps: float):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _bias_gelu(y, bias):
    return F.gelu(y if bias is None else y + bias)


def _bias_swiglu(gate, gate_bias, up, up_bias):
    if gate_bias is not None:
        gate, up = gate + gate_bias, up + up_bias
    return (F.silu(_wide(gate)) * _wide(up)).to(gate.dtype)


def _bias_dropout_add(y, bias, residual, p: float, training: bool):
    return residual + F.dropout(y if bias is None else y + bias, p, training)


def _rope(q, k, cos, sin, interleaved: bool):
    return apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Compiled ``x / sqrt(mean(x^2) + eps) * weight`` in fp32 (arXiv 1910.07467 Eq. 4);
    ``x`` ``[..., n]``, ``weight`` ``[n]``; output in ``x``'s dtype."""
    return _compiled(_rms_norm)(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """Compiled LayerNorm over the last dimension (arXiv 1607.06450 §3.1); ``x`` ``[..., n]``."""
    return _compiled(_layer_norm)(x, weight, bias, eps)


def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Compiled ``gelu(y + bias)`` (exact erf GeLU, as the eager MLP); ``y`` ``[..., f]``."""
    return _compiled(_bias_gelu)(y, bias)


def bias_swiglu(gate: torch.Tensor, gate_bias: torch.Tensor | None, up: torch.Tensor,
                up_bias: torch.Tensor | None) -> torch.Tensor:
    """Compiled ``silu(gate + gate_bias) * (up + up_bias)`` in fp32 (arXiv 2002.05202 Eq. 6);
    ``gate``, ``up`` ``[..., f]``; biases both or neither."""
    return _compiled(_bias_swiglu)(gate, gate_bias, up, up_bias)


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool) -> torch.Tensor:
    """Compiled ``residual + dropout(y + bias, p)``; all ``[b, s, h]`` (bias ``[h]``). The mask
    is drawn from the default generator's state at the call (see the module docstring)."""
    return _compiled(_bias_dropout_add)(y, bias, residual, p, training and p > 0)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled RoPE (arXiv 2104.09864 Eq. 34) on q ``[b, heads, s, d]`` and k
    ``[b, groups, s, d]`` with tables ``[s, r]``, as :func:`models.rope.apply_rotary`."""
    return _compiled(_rope)(q, k, cos, sin, interleaved)


def linear_skip_bias(linear: nn.Module, x: torch.Tensor):
    """``(linear's output without its bias, the bias or None)``, Megatron-LM's ``skip_bias_add``,
    for a fused consumer that adds the bias itself.

    A module with ``forward_skip_bias`` (the tensor-parallel linears) answers itself; a plain
    ``nn.Linear`` is ``F.linear`` without the bias; any other module is called as it is (its
    bias, if any, already added).
    """
    skip = getattr(linear, "forward_skip_bias", None)
    if skip is not None:
        return skip(x)
    if type(linear) is nn.Linear:
        return F.linear(x, linear.weight), linear.bias
    return linear(x), None


def linear_pair(first: nn.Module, second: nn.Module, x: torch.Tensor, skip_bias: bool = False):
    """``(first(x), second(x))``, or with ``skip_bias`` ``(y_first, bias_first, y_second,
    bias_second)`` as :func:`linear_skip_bias` gives them: SwiGLU's gate and up on one input.

    A ``first`` with ``forward_pair`` (the column-parallel linear) may answer for both, running
    the tensor-parallel collectives of the shared input once (Megatron-LM's single ``fc1`` of
    ``2 f`` rows does the same); when it declines (None), or for plain modules, each is called.
    """
    pair = getattr(first, "forward_pair", None)
    if pair is not None and (out := pair(second, x, skip_bias)) is not None:
        return out
    if skip_bias:
        return (*linear_skip_bias(first, x), *linear_skip_bias(second, x))
    return first(x), second(x)

