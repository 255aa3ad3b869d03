"""Activation bytes of one transformer layer (Korthikanti et al. 2022, arXiv 2205.05198, §4.1
and Table 2), for the GPT and the Llama family (SwiGLU, GQA, RMSNorm, RoPE, q/k norms).

``hybrid.planner.memory`` re-exports both functions; ``tests/test_llama_planner.py`` checks them
against the saved-bytes meter (``hybrid.activation.saved_bytes``) within 2%.

The dropout core counted is the explicit one (``models.blocks.Attention`` on CPU). On GPU
attention dropout runs inside the fused kernel, which keeps no ``s^2`` terms (the core then
keeps what the ``dropout=False`` core keeps), and selective recompute has nothing to recompute
on it: with dropout these figures are an upper bound there.
"""

from __future__ import annotations

import math

from hybrid.flops import RECOMPUTE_MODES
from models.config import GPTConfig


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def layer_activation_bytes(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_attention_heads: int,
    tp: int = 1,
    ffn_hidden_size: int | None = None,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_element: int = 2,
    mask_bytes: int = 1,
    *,
    shape: GPTConfig | None = None,
    dropout: bool = True,
) -> int:
    """Activation bytes one transformer layer keeps for backward, per TP rank.

    Element-by-element accounting of 2205.05198 §4.1 (activations ``bytes_per_element``, dropout
    masks ``mask_bytes``: 1 in the paper and CUDA, the activation dtype on CPU; norm
    statistics ignored), generalised to an MLP of width f:
    attention 11sbh + 5as^2b, MLP 3sbh + 4sbf, LayerNorms 4sbh. At f = 4h, 2 bytes:
    sbh(34 + 5as/h) with t = 1, sbh(10 + 24/t + 5as/(ht)) with TP, (sbh/t)(34 + 5as/h) with TP+SP,
    minus the 5as^2b/t term with selective recompute, and 2sbh (the layer input) with full
    recompute (Table 2; /t with SP, whose layer input is the s/t slice). Under TP the 10sbh
    replicated part is the two LayerNorm inputs, the QKV and fc1 inputs and the two residual
    dropout masks. Exact integer bytes (ceil of /t).

    ``shape`` (a :class:`GPTConfig`, whose h, a and f then win) adapts the terms to the Llama
    family; :func:`layer_saved_terms` derives them. ``dropout=False`` (the usual Llama setting)
    drops the three mask terms and takes the attention core through SDPA (no ``s^2`` terms).
    """
    _check_positive(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tp=tp,
    )
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if shape is None:
        shape = GPTConfig(num_layers=1, hidden_size=hidden_size,
                          num_attention_heads=num_attention_heads, vocab_size=1,
                          max_position_embeddings=1, ffn_hidden_size=ffn_hidden_size)
    s, b, e = seq_length, micro_batch_size, bytes_per_element
    sbh = s * b * shape.hidden_size
    if recompute == "full":
        return math.ceil(sbh * e / tp) if sequence_parallel else sbh * e
    terms = layer_saved_terms(shape, recompute, dropout, tp)
    tokens = s * b
    replicated = terms["replicated"] * tokens * e + terms["masks_replicated"] * tokens * mask_bytes
    split = terms["split"] * tokens * e + terms["fp32_split"] * tokens * 4
    split += terms["scores"] * s * tokens * (2 * e + mask_bytes)
    if sequence_parallel:
        return math.ceil((replicated + split) / tp)
    return replicated + math.ceil(split / tp)


def layer_saved_terms(shape: GPTConfig, recompute: str = "none", dropout: bool = True,
                      tp: int = 1) -> dict[str, int]:
    """Per-token element counts of what one layer saves for backward (before TP).

    Derivation (a heads of d channels, G K/V heads, width h, MLP f; per token, t = 1), following
    2205.05198 §4.1 step by step through ``models.blocks``:

    - Replicated under TP (``replicated``): the inputs of the two norms and of the QKV and first
      MLP linears, ``4h`` (an RMSNorm saves its input like a LayerNorm; its per-token fp32
      ``1/rms`` is ignored like LayerNorm statistics); ``masks_replicated``: the two residual
      dropout masks, ``2h`` (none without dropout).
    - Attention, split over t (``split``): with dropout the core is the explicit softmax, whose
      matmuls save contiguous q ``ad``, k ``Gd``, v ``Gd`` (RoPE's multiplications by the cached
      cos/sin save only the tables), plus the projection input ``ad``: ``(2a + 2G)d`` (= 4h for
      the GPT: Table 2's Q, K, V and projection input); ``scores``: the softmax output, its mask
      and the dropout output, ``a s`` each (Table 2's ``5as^2b`` at 2 bytes, 1-byte masks).
      Without dropout, SDPA keeps q and k as given (with RoPE the rotated copies, ``(a + G)d``),
      v as a view of the QKV output (which keeps all ``(a + 2G)d`` of it) and its output, the
      projection input ``ad``, plus an fp32 log-sum-exp per head (``fp32_split`` ``a``):
      ``(3a + 3G)d`` with RoPE, ``(2a + 2G)d`` without. Selective recompute keeps the core's
      inputs, the views of the QKV output, and the projection input: ``(2a + 2G)d``.
      Under GQA (a > G) with more than one group per TP rank (G > t) q is not a view of the QKV
      output (its a/G heads per group are not evenly strided) but an ``ad`` copy, kept where q
      itself is saved: by selective recompute, by SDPA without RoPE, and by a q norm.
      ``qk_layernorm``: the q/k norms' inputs keep the
      QKV output, ``(a + 2G)d`` more with the dropout core; their outputs are the core's inputs
      under selective recompute, ``(a + G)d`` more; under SDPA the rotated or normalised copies
      are counted already (so ``(3a + 3G)d``); their statistics are ``a + G`` fp32 values per
      token (RMSNorm; twice that for LayerNorm).
    - MLP, split over t: GeLU keeps its input and output, ``2f``; SwiGLU (``models.swiglu``)
      keeps gate, up and their product, ``3f`` (autograd's composite form would keep ``4f``).

    At G = a, d = h/a, f = 4h with dropout this is Table 2's ``34sbh + 5as^2b`` in bytes.

    Returns:
        ``{"replicated", "masks_replicated", "split", "fp32_split", "scores"}``, elements per
        token (``scores`` per token and per position of the sequence).
    """
    a, g, d = shape.num_attention_heads, shape.query_groups, shape.head_dim
    f = shape.ffn_hidden_size
    qkv, rope, qk = (a + 2 * g) * d, shape.position_embedding_type == "rope", shape.qk_layernorm
    qcopy = a * d if a > g and g > tp else 0  # q a copy, not a view: GQA, > 1 group per rank
    explicit_core = recompute == "none" and dropout
    if explicit_core:
        attn = (2 * a + 2 * g) * d + (qkv + qcopy if qk else 0)
    elif recompute == "selective":
        attn = (2 * a + 2 * g) * d + qcopy + ((a + g) * d if qk else 0)
    elif qk or rope:
        attn = (3 * a + 3 * g) * d + (qcopy if qk else 0)
    else:
        attn = (2 * a + 2 * g) * d + qcopy
    stats = (a + g) * (1 if shape.normalization == "RMSNorm" else 2) if qk else 0
    return {
        "replicated": 4 * shape.hidden_size,
        "masks_replicated": 2 * shape.hidden_size if dropout else 0,
        "split": attn + (3 if shape.swiglu else 2) * f,
        "fp32_split": (a if recompute == "none" and not dropout else 0) + stats,
        "scores": a if explicit_core else 0,
    }
