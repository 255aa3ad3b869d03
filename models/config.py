"""The one description of a decoder: :class:`GPTConfig`, every architecture field with its
derived values (SwiGLU width, query groups, head size), its validation and its parameter count.

Everything else takes this dataclass: the model (:mod:`models.gpt`, :mod:`models.blocks`), the
tensor-parallel plan, the planner, the FLOP arithmetic, the dry run and the Hugging Face interop.
Megatron-LM's model flags become one through ``hybrid.model_flags.resolve_model``.

Megatron-LM's resolution of ambiguous flag combinations, which this config follows: ``swiglu``
without ``ffn_hidden_size`` gives ``int(4h * 2/3 / 64) * 64`` (:func:`swiglu_width`);
``qk_layernorm`` uses the model's norm kind (LayerNorm q/k norms have a bias); ``rotary_percent
< 1`` rotates the leading channels of each head; ``rope_scaling_factor`` without
``use_rope_scaling`` has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.rope import RotaryEmbedding

__all__ = ["GPTConfig", "NORMALIZATIONS", "POSITION_EMBEDDING_TYPES", "invalid_query_groups",
           "swiglu_width"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def swiglu_width(hidden_size: int) -> int:
    """Megatron-LM's default SwiGLU width f for model width h: ``int(4h * 2/3 / 64) * 64``
    (elements; each of the two halves; Shazeer 2020, arXiv 2002.05202 §2 keeps the parameter
    count of a ``4h`` GeLU MLP, rounded down to a multiple of 64)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def invalid_query_groups(heads: int, groups: int) -> list[int] | None:
    """None when ``groups`` K/V heads divide ``heads`` query heads (each K/V head serves a whole
    number of query heads, arXiv 2305.13245 §2.2); otherwise the valid group counts."""
    if heads % groups == 0:
        return None
    return [x for x in range(1, heads + 1) if heads % x == 0]



@dataclass
class GPTConfig:
    """Shape and regularisation of the model (names follow Megatron-LM's flags)."""

    num_layers: int = 12
    """Number of transformer blocks (``--num-layers``)."""
    hidden_size: int = 768
    """Model width h (``--hidden-size``)."""
    num_attention_heads: int = 12
    """Attention (query) heads a (``--num-attention-heads``)."""
    ffn_hidden_size: int | None = None
    """MLP inner width f (each half under SwiGLU); None means ``4h``, or with ``swiglu``
    Megatron's ``int(4h * 2/3 / 64) * 64`` (``--ffn-hidden-size``)."""
    vocab_size: int = 50257
    """Real (unpadded) vocabulary size V; parallel layers pad it, never this model."""
    max_position_embeddings: int = 1024
    """Longest sequence; rows of the learned position table (``--max-position-embeddings``)."""
    hidden_dropout: float = 0.1
    """Dropout after the embeddings and on each residual branch (``--hidden-dropout``)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (``--attention-dropout``)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (``--norm-epsilon``, alias ``--layernorm-epsilon``)."""
    init_method_std: float = 0.02
    """Std of the normal init; residual output projections use std / sqrt(2 * num_layers)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of reusing ``wte.weight``."""
    label_smoothing: float = 0.0
    """Label smoothing of the language-model cross-entropy, in [0, 1)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute``, ``rope`` or ``none`` (``--position-embedding-type``)."""
    rotary_base: float = 10000
    """RoPE base theta (``--rotary-base``)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates, in (0, 1] (``--rotary-percent``)."""
    rotary_interleaved: bool = False
    """Rotate (even, odd) channel pairs instead of the two halves (``--rotary-interleaved``)."""
    use_rope_scaling: bool = False
    """Llama 3.1 RoPE frequency scaling (``--use-rope-scaling``)."""
    rope_scaling_factor: float = 8.0
    """Its factor (``--rope-scaling-factor``); no effect without ``use_rope_scaling``."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm`` (``--normalization``)."""
    swiglu: bool = False
    """SwiGLU MLP ``fc2(silu(gate(x)) * fc1(x))`` instead of GeLU (``--swiglu``)."""
    num_query_groups: int | None = None
    """K/V heads G of grouped-query attention; None means G = a (``--num-query-groups``)."""
    kv_channels: int | None = None
    """Channels per head d; None means h / a (``--kv-channels``)."""
    add_bias_linear: bool = True
    """Biases on every linear layer (False: ``--disable-bias-linear``)."""
    add_qkv_bias: bool = False
    """Bias on ``qkv`` even without ``add_bias_linear`` (``--add-qkv-bias``)."""
    qk_layernorm: bool = False
    """Normalise q and k per head before RoPE (``--qk-layernorm``)."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights: each norm scales by ``1 + w``, ``w`` initialised to 0
    (``--apply-layernorm-1p``; exported to Hugging Face as ``1 + w``)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (swiglu_width(self.hidden_size) if self.swiglu
                                    else 4 * self.hidden_size)
        self.validate()

    @property
    def head_dim(self) -> int:
        """Channels per attention head d: ``kv_channels``, else ``hidden_size // heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """K/V heads G (``num_attention_heads`` when ``num_query_groups`` is None)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def norm_epsilon(self) -> float:
        """``layernorm_epsilon`` under Megatron-LM's newer name."""
        return self.layernorm_epsilon

    @property
    def tied(self) -> bool:
        """True when the output layer reuses the word embedding."""
        return not self.untie_embeddings_and_output_weights

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field and the valid values."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for name in ("num_query_groups", "kv_channels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"GPTConfig.{name} must be a positive integer or None, got "
                                 f"{value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads} (or give kv_channels)"
            )
        a, g = self.num_attention_heads, self.query_groups
        if valid := invalid_query_groups(a, g):
            raise ValueError(f"num_attention_heads={a} is not divisible by num_query_groups={g}; "
                             f"valid groups: {valid}")
        for name in ("hidden_dropout", "attention_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {value!r}")
        self._validate_kinds()

    def _validate_kinds(self) -> None:
        for name, valid in (("position_embedding_type", POSITION_EMBEDDING_TYPES),
                            ("normalization", NORMALIZATIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}; valid: {valid}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"GPTConfig.rotary_percent={self.rotary_percent} must be in (0, 1]")
        for name in ("rotary_base", "rope_scaling_factor", "layernorm_epsilon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be > 0")
        if self.position_embedding_type == "rope":
            self.rotary()  # raises on an odd or empty rotary width

    def rotary(self) -> RotaryEmbedding | None:
        """A new :class:`models.rope.RotaryEmbedding` of this config, or None without RoPE."""
        if self.position_embedding_type != "rope":
            return None
        from models.rope import RotaryEmbedding  # torch: the config itself stays plain Python

        return RotaryEmbedding(self.head_dim, self.rotary_percent, self.rotary_base,
                               self.rotary_interleaved,
                               self.rope_scaling_factor if self.use_rope_scaling else None)

    def norm_parameters(self, size: int) -> int:
        """Elements of one norm of width ``size``: ``2 size`` (LayerNorm) or ``size`` (RMS)."""
        return size if self.normalization == "RMSNorm" else 2 * size

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection, ``(a + 2G) d``."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    def layer_parameter_split(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one transformer layer, in elements.

        GPT: attention 4h^2 + 4h (QKV 3h^2 + 3h column-parallel, projection h^2 row-parallel + h
        bias); MLP 2hf + f + h (fc1 hf + f column-parallel, fc2 fh row-parallel + h bias); two
        LayerNorms 4h. In general QKV is ``(a + 2G) d h`` (GQA), the projection ``a d h``, a
        SwiGLU MLP has two column-parallel ``[f, h]`` halves, biases follow ``add_bias_linear`` /
        ``add_qkv_bias``, RMSNorms have no bias and ``qk_layernorm`` adds two norms of width d.
        Row-parallel biases and norms are replicated on every TP rank (1909.08053 §3).
        """
        h, f, qkv = self.hidden_size, self.ffn_hidden_size, self.qkv_size
        halves = 2 if self.swiglu else 1
        sharded = qkv * h + self.num_attention_heads * self.head_dim * h + (halves + 1) * f * h
        sharded += qkv if self.add_bias_linear or self.add_qkv_bias else 0
        sharded += halves * f if self.add_bias_linear else 0
        replicated = 2 * h if self.add_bias_linear else 0
        replicated += 2 * self.norm_parameters(h) + (2 * self.norm_parameters(self.head_dim)
                                                     if self.qk_layernorm else 0)
        return sharded, replicated

    def parameter_split(self, final_layernorm: bool = True) -> tuple[int, int]:
        """(TP-sharded, replicated) parameter counts of the whole model, in elements.

        Sharded: the layers' column/row-parallel weights, the vocab-parallel word embedding (V h)
        and, if untied, the output matrix (V h). Replicated: row-parallel biases, norms, the
        learned position table (s h) and, with ``final_layernorm``, the final norm (2h, or h for
        RMSNorm; 2104.04473 Eq. 2 leaves it out).
        """
        h, v = self.hidden_size, self.vocab_size
        layer_sharded, layer_replicated = self.layer_parameter_split()
        sharded = self.num_layers * layer_sharded + v * h * (1 if self.tied else 2)
        replicated = self.num_layers * layer_replicated
        if self.position_embedding_type == "learned_absolute":
            replicated += self.max_position_embeddings * h
        if final_layernorm:
            replicated += self.norm_parameters(h)
        return sharded, replicated

    def num_parameters(self, final_layernorm: bool = True) -> int:
        """Exact parameter count of :class:`models.gpt.GPT` (elements, of ``vocab_size``).

        For the default GPT this equals the PTD-P formula ``12lh^2 + 13lh + (V+s)h``
        (Narayanan et al. 2021, arXiv 2104.04473 §5.1 Eq. 2, with f = 4h) plus the final
        LayerNorm's ``2h`` (left out with ``final_layernorm=False``), plus ``Vh`` when the output
        is untied. GPT-2 small gives 124,439,808. The sum of :meth:`parameter_split`.
        """
        return sum(self.parameter_split(final_layernorm))
