"""The transformer block of :class:`models.gpt.GPT`: norms, attention, MLP.

Tensor layout ``[b, s, h]``; attention internals ``[b, heads, s, d]``. Every module infers its
local head count from the shapes it receives, so the same code runs with all heads and with a
tensor-parallel rank's share (``hybrid.parallel.tp_plan`` swaps the linears, never this code).

Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245 §2.2): ``G`` K/V heads, each
shared by ``n = a / G`` query heads (``G = a`` is multi-head, ``G = 1`` multi-query). The fused
``qkv`` output is ordered ``(group, [q_1 .. q_n, k, v], d)`` as in Megatron-LM, so a contiguous
split of its rows over ``tp`` (with ``G % tp == 0``) gives each rank whole groups; at ``G = a``
this is the GPT's ``(head, q|k|v, d)`` order.

Run-time doors: ``hybrid/`` never edits this code; it opens the doors named here, one line each
at the place it opens them (``# door:``), in the order ``hybrid.parallelize`` lists them.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import fusion
from models.config import GPTConfig
from models.document_attention import block_causal_attention
from models.fusion import OFF, linear_pair, linear_skip_bias
from models.norms import LayerNorm, LayerNorm1P, RMSNorm, RMSNorm1P
from models.rope import RotaryEmbedding
from models.swiglu import swiglu

if TYPE_CHECKING:
    from models.documents import DocumentContext


def make_norm(config: GPTConfig, size: int) -> nn.Module:
    """:class:`models.norms.LayerNorm` (weight and bias) or :class:`models.norms.RMSNorm`
    (weight only; Zhang & Sennrich 2019, arXiv 1910.07467 Eq. 4) of width ``size``, per
    ``config.normalization``, with ``config.layernorm_epsilon``."""
    if config.apply_layernorm_1p:  # zero-centred weights, Megatron-LM's --apply-layernorm-1p
        kind = RMSNorm1P if config.normalization == "RMSNorm" else LayerNorm1P
        return kind(size, eps=config.layernorm_epsilon)
    if config.normalization == "RMSNorm":
        return RMSNorm(size, eps=config.layernorm_epsilon)
    return LayerNorm(size, eps=config.layernorm_epsilon)


def dropout_rng_scope(dropout: nn.Module) -> contextlib.AbstractContextManager | None:
    """The generator scope in which attention draws ``dropout``'s mask inside the fused kernel.

    A plain ``nn.Dropout`` draws from the default generator (a null scope); a module with an
    ``rng_scope()`` method (``hybrid.parallel.layers.TPRegionDropout``: the TP rank's stream)
    gives its own. Any other module (one that records or replays masks) returns None: attention
    then applies it to explicit probabilities.
    """
    if hasattr(dropout, "rng_scope"):
        return dropout.rng_scope()
    if type(dropout) is nn.Dropout:
        return contextlib.nullcontext()
    return None


class Attention(nn.Module):
    """Causal self-attention with optional GQA, RoPE and q/k norms. Input/output ``[b, s, h]``.

    ``qkv`` is ``[(a + 2G) d, h]``, ``proj`` is ``[h, a d]``. With ``qk_layernorm`` q and k are
    normalised per head over ``d`` (``q_norm``, ``k_norm``, one weight shared by all heads,
    the model's norm kind) before RoPE, as Megatron-LM does. :meth:`core` (RoPE, then the
    attention) is the part selective recompute replays in backward; the norms hold parameters
    and stay outside it.

    Args:
        config: the model's ``GPTConfig``.
        rotary: the model's shared :class:`RotaryEmbedding` (None without RoPE); a plain
            attribute, not a submodule, so it adds no names.
    """

    def __init__(self, config: GPTConfig, rotary: RotaryEmbedding | None = None):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        a, g = config.num_attention_heads, config.query_groups
        self.head_dim = d
        self.heads_per_group = a // g
        # door: qkv (column), proj (row), attn_dropout (TP stream) and q_norm/k_norm (summed over
        # the TP group) are swapped by the TP plan (hybrid.parallel.tp_plan)
        self.qkv = nn.Linear(h, (a + 2 * g) * d, bias=config.add_bias_linear or config.add_qkv_bias)
        self.proj = nn.Linear(a * d, h, bias=config.add_bias_linear)
        self.attn_dropout = nn.Dropout(config.attention_dropout)
        self.q_norm = make_norm(config, d) if config.qk_layernorm else None
        self.k_norm = make_norm(config, d) if config.qk_layernorm else None
        self.rotary = rotary
        self.fusion = OFF
        """:class:`models.fusion.KernelFusion`; ``rope`` runs RoPE compiled."""
        self.documents: DocumentContext | None = None
        """The model's :class:`models.documents.DocumentContext` (set by ``GPT``; a plain
        attribute): packed documents' positions and block-causal attention."""
        self.kernel = "auto"
        """Attention kernel with dropout: ``"auto"``, ``"fused"`` or ``"explicit"`` (see
        :meth:`core`; :func:`set_attention_kernel` sets every layer's)."""

    def fused_chains(self) -> tuple[str, ...]:
        """The :class:`models.fusion.KernelFusion` fields this module reads."""
        return ("rope",) if self.rotary is not None else ()

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
        # Probabilities as a tensor, for a dropout module that must see them (see core());
        # allowed: [b, 1, s, s] block-causal mask of packed documents (None: causal)
        b, heads, s, d = q.shape
        n = self.heads_per_group
        if n > 1:  # the n query heads of a group as n*s rows against its one K/V head: plain
            q = q.reshape(b, heads // n, n * s, d)  # batched matmuls, no repeated K/V copies
            v = v.contiguous()  # saved for backward: v alone, not the QKV output it views
        scores = ((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)).view(b, heads, s, s)
        if allowed is None:
            allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = self.attn_dropout(scores.softmax(dim=-1))
        if n > 1:
            return (probs.view(b, heads // n, n * s, s) @ v).view(b, heads, s, d)
        return probs @ v

    # door: replaced per instance by selective recompute (hybrid.activation.selective.SelectiveCore)
    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """RoPE on q, k, then ``dropout(softmax(q k^T / sqrt(d) + causal mask)) v``.

        q ``[b, heads, s, d]``; k, v ``[b, groups, s, d]``; output ``[b, heads, s, d]``.

        With dropout, :attr:`kernel` picks the path. ``"fused"``:
        ``F.scaled_dot_product_attention`` with ``dropout_p`` = the dropout module's ``p``, the
        mask drawn inside the module's :func:`dropout_rng_scope` (the default generator for
        ``nn.Dropout``, the TP rank's stream for the tensor-parallel dropout), so activation
        recompute, which restores both, replays it. On CUDA that is the flash /
        memory-efficient kernel, which keeps no ``[b, a, s, s]`` tensor for backward.
        ``"explicit"``: the softmax written out, the dropout module applied to the
        probabilities (Korthikanti et al. 2022, arXiv 2205.05198, Table 2's ``5as^2b``).
        ``"auto"`` (default): fused except on CPU, where torch has no fused kernel with
        dropout (its math fallback keeps the probabilities, mask and output in fp32 even for
        bf16 inputs, 1.8x the explicit path's saved bytes) and the explicit path is the lighter
        one. A dropout module of another kind (one that records or replays masks, as the
        exactness tests do) always takes the explicit path: the fused kernel never
        materialises the probabilities it must see. Without dropout (or in eval) every kernel
        is SDPA without dropout.
        """
        docs = self.documents.current if self.documents is not None else None
        positions = None if docs is None else docs.position_ids
        if self.rotary is not None and self.fusion.rope:
            cos, sin = self.rotary.tables(q.shape[-2], q.device, q.dtype)
            if positions is not None:  # documents' restarting positions: [b, 1, s, r]
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            q, k = fusion.rope(q, k, cos, sin, self.rotary.interleaved)
        elif self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        blocks = docs if docs is not None and docs.document_ids is not None else None
        p = self.attn_dropout.p if self.training else 0.0
        scope = contextlib.nullcontext()
        if p > 0:
            fused = self.kernel == "fused" or self.kernel == "auto" and q.device.type != "cpu"
            scope = dropout_rng_scope(self.attn_dropout) if fused else None
            if scope is None:
                return self._explicit(q, k, v, None if blocks is None else blocks.mask())
        gqa = {"enable_gqa": True} if self.heads_per_group > 1 else {}
        if blocks is not None:
            return block_causal_attention(q, k, v, blocks, p, scope, gqa)
        with scope:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``qkv`` output ``[b, s, G_local (n + 2) d]`` -> q ``[b, s, G_local n, d]``, k and v
        ``[b, s, G_local, d]``."""
        b, s = qkv.shape[:2]
        n = self.heads_per_group
        qkv = qkv.view(b, s, -1, n + 2, self.head_dim)  # [b, s, groups_local, n + 2, d]
        if n == 1:
            return qkv.unbind(dim=3)
        return qkv[:, :, :, :n].flatten(2, 3), qkv[:, :, :, n], qkv[:, :, :, n + 1]

    def forward(self, x: torch.Tensor, skip_bias: bool = False):
        """``[b, s, h]`` -> ``[b, s, h]``; with ``skip_bias`` ``(output without the projection's
        bias, that bias or None)`` for a fused bias-dropout-add."""
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        q, k, v = self.split_qkv(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = self.core(*(t.transpose(1, 2) for t in (q, k, v)))  # each [b, heads_local, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)
        return linear_skip_bias(self.proj, y) if skip_bias else self.proj(y)


ATTENTION_KERNELS = ("auto", "fused", "explicit")


def set_attention_kernel(model: nn.Module, kernel: str) -> None:
    """Set :attr:`Attention.kernel` of every attention module of ``model``.

    Raises:
        ValueError: ``kernel`` not in :data:`ATTENTION_KERNELS` (named with the valid ones).
    """
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {ATTENTION_KERNELS}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = kernel


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``, or with ``swiglu`` ``fc2(silu(gate(x)) * fc1(x))`` (Shazeer 2020,
    arXiv 2002.05202 Eq. 6; :func:`models.swiglu.swiglu` saves only gate and up). ``gate`` and
    ``fc1`` (the "up" projection) are each ``[f, h]``,
    ``fc2`` is ``[h, f]``. Input/output ``[b, s, h]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        # door: gate and fc1 (column), fc2 (row) are swapped by the TP plan (token-wise under SP)
        self.gate = nn.Linear(h, f, bias=bias) if config.swiglu else None
        self.fc1 = nn.Linear(h, f, bias=bias)
        self.fc2 = nn.Linear(f, h, bias=bias)
        self.fusion = OFF
        """:class:`models.fusion.KernelFusion`: ``bias_swiglu`` / ``bias_gelu`` compiled."""

    def fused_chains(self) -> tuple[str, ...]:
        """The :class:`models.fusion.KernelFusion` fields this module reads."""
        return ("bias_swiglu",) if self.gate is not None else ("bias_gelu",)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` -> the activation ``[b, s, f]`` that ``fc2`` consumes."""
        if self.gate is not None and self.fusion.bias_swiglu:
            return fusion.bias_swiglu(*linear_pair(self.gate, self.fc1, x, skip_bias=True))
        if self.gate is not None:
            return swiglu(*linear_pair(self.gate, self.fc1, x))
        if self.fusion.bias_gelu:
            return fusion.bias_gelu(*linear_skip_bias(self.fc1, x))
        return F.gelu(self.fc1(x))

    def forward(self, x: torch.Tensor, skip_bias: bool = False):
        """``[b, s, h]`` -> ``[b, s, h]``; with ``skip_bias`` ``(output without fc2's bias, that
        bias or None)`` for a fused bias-dropout-add."""
        y = self.activation(x)
        return linear_skip_bias(self.fc2, y) if skip_bias else self.fc2(y)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop(attn(ln1(x)))`` then ``+ drop(mlp(ln2(.)))``."""

    def __init__(self, config: GPTConfig, rotary: RotaryEmbedding | None = None):
        super().__init__()
        # door: ln1/ln2 and drop1/drop2 are swapped under sequence parallelism (the TP plan's
        # SEQUENCE_PARALLEL_PLAN); a LayerNorm becomes apex's fused one on CUDA (hybrid.fusion)
        self.ln1 = make_norm(config, config.hidden_size)
        self.attn = Attention(config, rotary)
        self.ln2 = make_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.drop1 = nn.Dropout(config.hidden_dropout)
        self.drop2 = nn.Dropout(config.hidden_dropout)
        self.fusion = OFF
        """:class:`models.fusion.KernelFusion`; ``bias_dropout`` fuses each branch's output
        bias, dropout and residual add (:func:`bias_dropout_add`)."""

    def fused_chains(self) -> tuple[str, ...]:
        """The :class:`models.fusion.KernelFusion` fields this module reads."""
        return ("bias_dropout",)

    # door: replaced per instance by activation checkpointing (hybrid.activation.apply), and
    # hooked before/after by ZeRO-3, which gathers and frees the block's parameters (zero.stage3)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fusion.bias_dropout:
            x = bias_dropout_add(*self.attn(self.ln1(x), skip_bias=True), self.drop1, x)
            return bias_dropout_add(*self.mlp(self.ln2(x), skip_bias=True), self.drop2, x)
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor | None, dropout: nn.Module,
                     residual: torch.Tensor) -> torch.Tensor:
    """``residual + dropout(y + bias)`` as one compiled region (:func:`models.fusion.
    bias_dropout_add`), its mask drawn in ``dropout``'s generator scope
    (:func:`dropout_rng_scope`: the default generator, or the TP rank's stream). A dropout
    module of another kind (one that records or replays masks) is called on ``y + bias``
    instead: it must see the tensor. All ``[b, s, h]`` (this rank's ``s/t`` under SP)."""
    p = dropout.p if dropout.training else 0.0
    scope = dropout_rng_scope(dropout) if p > 0 else contextlib.nullcontext()
    if scope is None:
        return residual + dropout(y if bias is None else y + bias)
    with scope:
        return fusion.bias_dropout_add(y, bias, residual, p, p > 0)
