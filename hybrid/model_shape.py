"""The handful of GPT dimensions the memory planner and the FLOP arithmetic need.

``ModelShape`` is the plain-number way to describe a model. Every function of ``hybrid.flops``,
``hybrid.planner.memory`` and ``hybrid.planner.plan`` that takes a ``model`` also accepts any object
with the same attribute names, e.g. ``models.gpt.GPTConfig`` (duck typing; ``ModelShape.of`` does
the conversion and validation once).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder: GPT-2 style (pre-LN, learned positions, GeLU MLP) by default,
    Llama style with ``swiglu``, ``num_query_groups`` and ``kv_channels``."""

    num_layers: int
    """Transformer layers l (L)."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Attention heads a."""
    vocab_size: int
    """Vocabulary V as seen by the embedding (pad it first with
    ``hybrid.parallel.vocab.pad_vocab_size``)."""
    max_position_embeddings: int
    """Rows of the learned position table (s in the parameter formula)."""
    ffn_hidden_size: int | None = None
    """MLP width f; None means 4h."""
    untie_embeddings_and_output_weights: bool = False
    """True adds a separate V x h output matrix."""
    final_layernorm: bool = True
    """Count the final LayerNorm (2h parameters); 2104.04473's formula leaves it out."""
    swiglu: bool = False
    """SwiGLU MLP (``--swiglu``): gate and up each ``[f, h]``, fc2 ``[h, f]``."""
    num_query_groups: int | None = None
    """K/V heads G under grouped-query attention; None means G = a (multi-head)."""
    kv_channels: int | None = None
    """Channels per attention head d (``--kv-channels``); None means h / a."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias, 2 x width) or ``RMSNorm`` (weight only)."""
    position_embedding_type: str = "learned_absolute"
    """Only ``learned_absolute`` has a position table (s h parameters)."""
    add_bias_linear: bool = True
    """Biases on every linear layer (False under ``--disable-bias-linear``)."""
    add_qkv_bias: bool = False
    """QKV bias even without ``add_bias_linear``."""
    qk_layernorm: bool = False
    """Per-head q and k norms of width d."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ffn_hidden_size is not None and (
            not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size <= 0
        ):
            raise ValueError(
                f"ffn_hidden_size must be a positive integer or None, got {self.ffn_hidden_size!r}"
            )
        for name in ("num_query_groups", "kv_channels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.query_groups}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def query_groups(self) -> int:
        """K/V heads G (a when ``num_query_groups`` is None)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels per head d (h / a when ``kv_channels`` is None)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def norm_parameters(self, size: int) -> int:
        """Elements of one norm of width ``size`` (2 size for LayerNorm, size for RMSNorm)."""
        return size if self.normalization == "RMSNorm" else 2 * size

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection, ``(a + 2G) d``."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def ffn(self) -> int:
        """MLP width f in elements (4h when ``ffn_hidden_size`` is None)."""
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @classmethod
    def of(cls, model: object) -> ModelShape:
        """Convert any object with GPTConfig's attribute names (or a ModelShape) to a ModelShape.

        Missing optional attributes take the defaults above; ``max_position_embeddings`` may be
        spelled ``seq_length`` (Megatron). Raises ValueError on a missing or bad dimension.
        """
        if isinstance(model, cls):
            return model

        def need(name: str, *aliases: str) -> int:
            for n in (name, *aliases):
                if getattr(model, n, None) is not None:
                    return getattr(model, n)
            raise ValueError(f"model {type(model).__name__} has no attribute {name!r}")

        return cls(
            num_layers=need("num_layers"),
            hidden_size=need("hidden_size"),
            num_attention_heads=need("num_attention_heads"),
            vocab_size=need("vocab_size", "padded_vocab_size"),
            max_position_embeddings=need("max_position_embeddings", "seq_length"),
            ffn_hidden_size=getattr(model, "ffn_hidden_size", None),
            untie_embeddings_and_output_weights=bool(
                getattr(model, "untie_embeddings_and_output_weights", False)
            ),
            final_layernorm=bool(getattr(model, "final_layernorm", True)),
            swiglu=bool(getattr(model, "swiglu", False)),
            num_query_groups=getattr(model, "num_query_groups", None),
            kv_channels=getattr(model, "kv_channels", None),
            normalization=getattr(model, "normalization", "LayerNorm"),
            position_embedding_type=getattr(model, "position_embedding_type", "learned_absolute"),
            add_bias_linear=bool(getattr(model, "add_bias_linear", True)),
            add_qkv_bias=bool(getattr(model, "add_qkv_bias", False)),
            qk_layernorm=bool(getattr(model, "qk_layernorm", False)),
        )
