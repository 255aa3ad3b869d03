"""A plain GPT-2 / GPT-3 style decoder: the single-process reference for every parallel run.

Learned absolute positions, pre-LayerNorm blocks, GeLU MLP of ``ffn_hidden_size``, output
layer tied to the input embedding by default. This file never imports ``torch.distributed``:
``hybrid.parallel.tp_plan`` swaps modules to make it tensor-parallel.

Tensor layout is ``[b, s, h]`` (micro-batch, sequence, hidden) throughout.

Parameter names are stable and used by checkpoints and the TP plan::

    wte.weight                  [V, h]     word embedding (also the output layer when tied)
    wpe.weight                  [s_max, h] learned positions
    layers.{i}.ln1.{weight,bias}
    layers.{i}.attn.qkv.{weight,bias}   [3h, h]: rows ordered (head, q|k|v, head_dim) so that a
                                       contiguous row split gives each TP rank whole heads
    layers.{i}.attn.proj.{weight,bias}  [h, h]
    layers.{i}.ln2.{weight,bias}
    layers.{i}.mlp.fc1.{weight,bias}    [f, h]
    layers.{i}.mlp.fc2.{weight,bias}    [h, f]
    ln_f.{weight,bias}
    lm_head.weight              [V, h]     only with ``untie_embeddings_and_output_weights``
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT model (names follow Megatron-LM's flags)."""

    num_layers: int = 12
    """Number of transformer blocks (``--num-layers``)."""
    hidden_size: int = 768
    """Model width h (``--hidden-size``)."""
    num_attention_heads: int = 12
    """Attention heads a; must divide ``hidden_size`` (``--num-attention-heads``)."""
    ffn_hidden_size: int | None = None
    """MLP inner width f; None means ``4 * hidden_size`` (``--ffn-hidden-size``)."""
    vocab_size: int = 50257
    """Real (unpadded) vocabulary size V; parallel layers pad it, never this model."""
    max_position_embeddings: int = 1024
    """Longest sequence the learned position table covers (``--max-position-embeddings``)."""
    hidden_dropout: float = 0.1
    """Dropout after the embeddings and on each residual branch (``--hidden-dropout``)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (``--attention-dropout``)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (``--layernorm-epsilon``)."""
    init_method_std: float = 0.02
    """Std of the normal init; residual output projections use std / sqrt(2 * num_layers)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of reusing ``wte.weight``."""
    label_smoothing: float = 0.0
    """Label smoothing of the language-model cross-entropy, in [0, 1)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self.validate()

    @property
    def head_dim(self) -> int:
        """Channels per attention head, ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def tied(self) -> bool:
        """True when the output layer reuses the word embedding."""
        return not self.untie_embeddings_and_output_weights

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        for name in ("hidden_dropout", "attention_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {value!r}")

    def num_parameters(self) -> int:
        """Exact parameter count of :class:`GPT` (elements, unpadded vocabulary).

        Equals the PTD-P formula ``12lh^2 + 13lh + (V+s)h`` (Narayanan et al. 2021, §5.1 Eq. 2,
        with f = 4h) plus the final LayerNorm's ``2h``, plus ``Vh`` when the output is untied.
        """
        h, f, n = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h) + 4 * h
        total = n * per_layer + (self.vocab_size + self.max_position_embeddings) * h + 2 * h
        if not self.tied:
            total += self.vocab_size * h
        return total


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from the job seed and a parameter's name (stable across runs)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def draws_normal(name: str) -> bool:
    """Whether :func:`init_parameter` draws parameter ``name`` from N(0, std) (else a fill)."""
    return not name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight", "bias"))


@torch.no_grad()
def init_parameter(name: str, tensor: torch.Tensor, config: GPTConfig,
                   generator: torch.Generator | None = None) -> None:
    """GPT-2 / Megatron init of the full (unsharded) parameter ``name``, in place.

    N(0, init_method_std) weights, zero biases, unit LayerNorm weights, and
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


class Attention(nn.Module):
    """Causal multi-head self-attention. Input and output ``[b, s, h]``.

    The local head count and the sequence length are inferred from ``qkv``'s output, so the
    same code runs with all heads (single process), with ``heads / tp`` of them (column-parallel
    ``qkv``), and with an input holding a slice of the sequence that ``qkv`` gathers (sequence
    parallelism). :meth:`core` is the part selective recompute replays in backward.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.attn_dropout = nn.Dropout(config.attention_dropout)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``dropout(softmax(q k^T / sqrt(d) + causal mask)) v``: q, k, v, output
        ``[b, heads, s, d]``."""
        if self.attn_dropout.p > 0 and self.training:
            # Explicit softmax so that the dropout mask comes from the (swappable) dropout module,
            # whose RNG stream the TP plan controls; SDPA would draw from the default generator.
            s = q.shape[-2]
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            return self.attn_dropout(scores.softmax(dim=-1)) @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # [b, s, heads_local, 3, d]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads_local, s, d]
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with inner width ``ffn_hidden_size``. Input/output ``[b, s, h]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + drop(attn(ln1(x)))`` then ``+ drop(mlp(ln2(.)))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)
        self.drop1 = nn.Dropout(config.hidden_dropout)
        self.drop2 = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


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
    """GPT decoder. ``forward(tokens [b, s], labels [b, s] | None)``.

    Returns per-token losses ``[b, s]`` (fp32) when ``labels`` is given, else logits ``[b, s, V]``.
    Build on ``torch.device("meta")`` to size a model without memory, then ``to_empty`` and
    :meth:`init_weights`.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = nn.Embedding(config.max_position_embeddings, h)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(h, eps=config.layernorm_epsilon)
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
        """Token + position embeddings with dropout: ``[b, s]`` ids -> ``[b, s, h]``."""
        s = tokens.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {s} exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
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
