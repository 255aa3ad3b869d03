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

The config (:class:`GPTConfig`, its derived values and validation) lives in
:mod:`models.config`; it is re-exported here.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.blocks import MLP, Attention, Block, make_norm
from models.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig
from models.documents import DocumentContext, Documents

__all__ = ["GPT", "GPTConfig", "Attention", "Block", "MLP", "NORMALIZATIONS",
           "POSITION_EMBEDDING_TYPES", "init_parameter", "draws_normal", "parameter_generator"]

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
        one = 0.0 if config.apply_layernorm_1p else 1.0  # the norm scales by 1 + w
        tensor.zero_() if name.endswith("bias") else tensor.fill_(one)
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
        # door: wte (vocab-parallel), output_layer (parallel logits), loss_fn (vocab-parallel
        # cross-entropy) are swapped by the TP plan; wpe, drop and ln_f too under SP
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = (nn.Embedding(config.max_position_embeddings, h)
                    if config.position_embedding_type == "learned_absolute" else None)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.rotary = config.rotary()  # shared by every layer's attention (one table cache)
        self.layers = nn.ModuleList(Block(config, self.rotary) for _ in range(config.num_layers))
        self.documents = DocumentContext()  # the micro-batch's documents, read by attention
        for block in self.layers:
            block.attn.documents = self.documents
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

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings with dropout: ``[b, s]`` ids -> ``[b, s, h]``;
        ``positions`` ``[b, s]``: the documents' restarting positions (default ``0..s-1``).

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
        pos = torch.arange(s, device=tokens.device) if positions is None else positions
        return self.drop(self.wte(tokens) + self.wpe(pos))

    # door: hooked before/after by ZeRO-3 (the root unit's gather and free, hybrid.zero.stage3);
    # every parameter's post-accumulate-grad hook is ZeRO's gradient reduce (hybrid.zero.reduce)
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """``documents``: packed documents' positions and block-causal attention
        (:mod:`models.documents`); None: one causal sequence."""
        self.documents.current = documents
        x = self.embed(tokens, None if documents is None else documents.position_ids)
        for block in self.layers:
            x = block(x)
        logits = self.output_layer(self.ln_f(x), self.output_weight())
        if labels is None:
            return logits
        return self.loss_fn(logits, labels)
