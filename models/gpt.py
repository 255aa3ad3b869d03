"""A plain decoder: GPT-2 / GPT-3 by default, Llama-class with Megatron-LM's model flags.

Default: learned absolute positions, pre-LayerNorm blocks, GeLU MLP of ``ffn_hidden_size``,
multi-head attention, biases, output layer tied to the input embedding. The Llama family sets
``position_embedding_type="rope"`` (:mod:`models.rope`), ``normalization="RMSNorm"``,
``swiglu``, ``num_query_groups`` (grouped-query attention), ``add_bias_linear=False`` and
``untie_embeddings_and_output_weights`` (blocks: :mod:`models.blocks`). This is the
single-process reference for every parallel run and never imports ``torch.distributed``:
``hybrid.parallel.tp_plan`` swaps modules to make it tensor-parallel.

Tensor layout is ``[b, s, h]`` (micro-batch, sequence, hidden) throughout; ``a`` heads of ``d``
channels, ``G`` K/V groups, MLP width ``f``.

Parameter names are stable and used by checkpoints and the TP plan::

    wte.weight                  [V, h]     word embedding (also the output layer when tied)
    wpe.weight                  [s_max, h] learned positions (learned_absolute only)
    layers.{i}.ln1.{weight,bias}           bias only under LayerNorm (also ln2, ln_f, q/k_norm)
    layers.{i}.attn.qkv.{weight,bias}   [(a + 2G) d, h]: rows ordered (group, [q_1..q_{a/G}, k,
                                       v], d) so that a contiguous row split gives each TP rank
                                       whole groups; at G = a: (head, q|k|v, d)
    layers.{i}.attn.q_norm.weight, k_norm.weight  [d]   only with ``qk_layernorm``
    layers.{i}.attn.proj.{weight,bias}  [h, a d]
    layers.{i}.ln2.{weight,bias}
    layers.{i}.mlp.gate.{weight,bias}   [f, h]     only with ``swiglu`` (the SiLU-gated half)
    layers.{i}.mlp.fc1.{weight,bias}    [f, h]     the GeLU input, or SwiGLU's "up" half
    layers.{i}.mlp.fc2.{weight,bias}    [h, f]
    ln_f.{weight,bias}
    lm_head.weight              [V, h]     only with ``untie_embeddings_and_output_weights``

Linear biases exist unless ``add_bias_linear`` is False (``--disable-bias-linear``); ``qkv``
keeps its bias then with ``add_qkv_bias``. SwiGLU keeps its two halves as two parameters of the
same shape (Megatron-LM fuses them as ``linear_fc1`` ``[2f, h]``): each is column-parallel, so
tensor-parallel rank ``r`` holds rows ``[r f/t, (r+1) f/t)`` of both, the matching slices of
gate and up, with the ordinary row split, checkpoint resharding and per-name seeded init.

Megatron-LM's resolution of ambiguous flag combinations, which this model and
``hybrid.job.config_checks`` follow: ``swiglu`` without ``ffn_hidden_size`` gives
``int(4h * 2/3 / 64) * 64``; ``qk_layernorm`` uses the model's norm kind (LayerNorm q/k norms
have a bias); ``rotary_percent < 1`` rotates the leading channels of each head;
``rope_scaling_factor`` without ``use_rope_scaling`` has no effect.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.blocks import MLP, Attention, Block, make_norm
from models.rope import RotaryEmbedding

__all__ = ["GPT", "GPTConfig", "Attention", "Block", "MLP", "init_parameter", "draws_normal",
           "parameter_generator"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
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
        if a % g:
            valid = [x for x in range(1, a + 1) if a % x == 0]
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
        return RotaryEmbedding(self.head_dim, self.rotary_percent, self.rotary_base,
                               self.rotary_interleaved,
                               self.rope_scaling_factor if self.use_rope_scaling else None)

    def norm_parameters(self, size: int) -> int:
        """Elements of one norm of width ``size``: ``2 size`` (LayerNorm) or ``size`` (RMS)."""
        return size if self.normalization == "RMSNorm" else 2 * size

    def num_parameters(self) -> int:
        """Exact parameter count of :class:`GPT` (elements, unpadded vocabulary).

        For the default GPT this equals the PTD-P formula ``12lh^2 + 13lh + (V+s)h``
        (Narayanan et al. 2021, §5.1 Eq. 2, with f = 4h) plus the final LayerNorm's ``2h``,
        plus ``Vh`` when the output is untied. In general per layer: ``qkv`` ``(a + 2G) d h``,
        ``proj`` ``a d h``, MLP ``(2 or 3) f h`` (GeLU or SwiGLU), their biases, two norms and
        the optional q/k norms of width d; the position table only when learned.
        """
        h, f, n = self.hidden_size, self.ffn_hidden_size, self.num_layers
        d, a, g = self.head_dim, self.num_attention_heads, self.query_groups
        qkv_out, bias = (a + 2 * g) * d, self.add_bias_linear
        attn = qkv_out * h + a * d * h + (qkv_out if bias or self.add_qkv_bias else 0)
        attn += (h if bias else 0) + (2 * self.norm_parameters(d) if self.qk_layernorm else 0)
        mlp = (3 if self.swiglu else 2) * f * h + ((2 if self.swiglu else 1) * f + h) * bias
        total = n * (attn + mlp + 2 * self.norm_parameters(h)) + self.vocab_size * h
        if self.position_embedding_type == "learned_absolute":
            total += self.max_position_embeddings * h
        total += self.norm_parameters(h)
        if not self.tied:
            total += self.vocab_size * h
        return total


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from the job seed and a parameter's name (stable across runs)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def draws_normal(name: str) -> bool:
    """Whether :func:`init_parameter` draws parameter ``name`` from N(0, std) (else a fill)."""
    return not name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight", "q_norm.weight",
                              "k_norm.weight", "bias"))


@torch.no_grad()
def init_parameter(name: str, tensor: torch.Tensor, config: GPTConfig,
                   generator: torch.Generator | None = None) -> None:
    """GPT-2 / Megatron init of the full (unsharded) parameter ``name``, in place.

    N(0, init_method_std) weights, zero biases, unit norm weights (LayerNorm, RMSNorm, q/k
    norms), and
    std / sqrt(2 * num_layers) for the residual output projections (Megatron-LM §4.2). With a
    CPU ``generator`` the values are drawn on CPU and copied, so they do not depend on device.
    """
    std = config.init_method_std
    if not draws_normal(name):
        tensor.zero_() if name.endswith("bias") else tensor.fill_(1.0)
    else:
        if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
            std = std / math.sqrt(2.0 * config.num_layers)
        if generator is None:
            tensor.normal_(0.0, std)
        else:
            tensor.copy_(torch.empty(tensor.shape).normal_(0.0, std, generator=generator))


class OutputLayer(nn.Module):
    """Logits ``[b, s, V] = h @ weight.T``; the weight is passed in (tied or not)."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, weight)


class LanguageModelLoss(nn.Module):
    """Per-token cross-entropy ``[b, s]`` from logits ``[b, s, V]`` and labels ``[b, s]``."""

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.float().flatten(0, -2),
            labels.flatten(),
            reduction="none",
            label_smoothing=self.label_smoothing,
        )
        return loss.view_as(labels)


class GPT(nn.Module):
    """The decoder. ``forward(tokens [b, s], labels [b, s] | None)``.

    Returns per-token losses ``[b, s]`` (fp32) when ``labels`` is given, else logits ``[b, s, V]``.
    Build on ``torch.device("meta")`` to size a model without memory, then ``to_empty`` and
    :meth:`init_weights`.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = (nn.Embedding(config.max_position_embeddings, h)
                    if config.position_embedding_type == "learned_absolute" else None)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.rotary = config.rotary()  # shared by every layer's attention (one table cache)
        self.layers = nn.ModuleList(Block(config, self.rotary) for _ in range(config.num_layers))
        self.ln_f = make_norm(config, h)
        self.lm_head = None if config.tied else nn.Linear(h, config.vocab_size, bias=False)
        self.output_layer = OutputLayer()
        self.loss_fn = LanguageModelLoss(config.label_smoothing)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter with :func:`init_parameter`.

        With ``seed`` each parameter draws from its own generator seeded from ``(seed, name)``,
        so a tensor-parallel model initialised shard by shard gets exactly these values
        whatever its tp; without it, the default generator is used in parameter order.
        """
        for name, p in self.named_parameters():
            init_parameter(name, p, self.config,
                           parameter_generator(seed, name) if seed is not None else None)

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight: ``wte.weight`` when tied, else ``lm_head.weight``."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings with dropout: ``[b, s]`` ids -> ``[b, s, h]``.

        Raises:
            ValueError: ``s`` exceeds ``max_position_embeddings``.
        """
        s = tokens.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {s} exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        if self.wpe is None:
            return self.drop(self.wte(tokens))
        pos = torch.arange(s, device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(pos))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        logits = self.output_layer(self.ln_f(x), self.output_weight())
        if labels is None:
            return logits
        return self.loss_fn(logits, labels)
