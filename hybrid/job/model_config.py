"""The run's model from its flags: a preset, the explicit shape and Megatron-LM's architecture
flags over it, resolved as Megatron-LM resolves them (``--group-query-attention``,
``--num-query-groups``, the RoPE flags), with the refusals that need no grid."""

from __future__ import annotations

from dataclasses import replace

from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError
from models.gpt import GPTConfig
from models.presets import get_preset

ROPE_FLAGS = ("rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling",
              "rope_scaling_factor")
ARCHITECTURE_FLAGS = ("position_embedding_type", *ROPE_FLAGS, "normalization", "swiglu",
                      "kv_channels", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                      "untie_embeddings_and_output_weights")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _architecture(m, base: GPTConfig | None) -> dict:
    """The architecture fields given on the command line (the rest stay the preset's, or
    GPTConfig's defaults), resolved as Megatron-LM does: ``--group-query-attention`` without
    ``--num-query-groups`` is G = 1 (multi-query), ``--num-query-groups`` without
    ``--group-query-attention`` is ignored (a preset with G K/V heads counts as giving it).

    Raises:
        ConfigError: a RoPE flag (``--rotary-*``, ``--use-rope-scaling``,
            ``--rope-scaling-factor``) without RoPE.
    """
    out = {k: getattr(m, k) for k in ARCHITECTURE_FLAGS if getattr(m, k) is not None}
    kind = out.get("position_embedding_type",
                   base.position_embedding_type if base else "learned_absolute")
    given = [_flag(k) for k in ROPE_FLAGS if getattr(m, k) not in (None, False)]
    if kind != "rope" and given:
        raise ConfigError(f"{', '.join(given)} need(s) --position-embedding-type rope (or "
                          f"--use-rotary-position-embeddings); the model's is {kind}")
    gqa = m.group_query_attention
    if gqa is None:
        gqa = base is not None and base.num_query_groups is not None
    if not gqa:
        out["num_query_groups"] = None
    elif m.num_query_groups is not None or base is None or base.num_query_groups is None:
        out["num_query_groups"] = m.num_query_groups or 1
    return out


def model_config(cfg: PretrainConfig, vocab: int) -> GPTConfig:
    """The run's :class:`GPTConfig`: the preset (if any), the explicit shape and architecture
    flags over it, and the vocabulary ``vocab``.

    Raises:
        ConfigError: an unknown preset, missing shape flags, a RoPE flag without RoPE, query
            groups that do not divide the heads, or a shape GPTConfig refuses (named).
    """
    m = cfg.model
    try:
        base = get_preset(m.preset) if m.preset else None
    except KeyError as e:
        raise ConfigError(f"--preset: {e.args[0]}") from None
    required = ("num_layers", "hidden_size", "num_attention_heads")
    dims = {k: getattr(m, k) for k in (*required, "ffn_hidden_size")}
    if base is None:
        missing = [f"--{k.replace('_', '-')}" for k in required if dims[k] is None]
        if missing:
            raise ConfigError(f"give --preset or all of {', '.join(missing)}")
    overrides = {k: v for k, v in dims.items() if v is not None}
    overrides.update(_architecture(m, base))
    reshaped = base is not None and ("hidden_size" in overrides
                                     or overrides.get("swiglu", base.swiglu) != base.swiglu)
    if reshaped and "ffn_hidden_size" not in overrides:
        overrides["ffn_hidden_size"] = None  # Megatron's default width for the new shape
    max_pos = m.max_position_embeddings or (
        max(base.max_position_embeddings, m.seq_length) if base is not None else m.seq_length)
    common = dict(vocab_size=vocab, max_position_embeddings=max_pos,
                  hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                  init_method_std=m.init_method_std, layernorm_epsilon=m.layernorm_epsilon)
    _check_heads(overrides.get("num_attention_heads", base and base.num_attention_heads),
                 overrides.get("num_query_groups", base and base.num_query_groups))
    try:
        if base is None:
            return GPTConfig(**overrides, **common)
        return replace(base, **overrides, **common)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_heads(heads: int, groups: int | None) -> None:
    """``--num-query-groups`` divides ``--num-attention-heads`` (each K/V head serves a/G)."""
    if groups is not None and heads % groups:
        valid = [g for g in range(1, heads + 1) if heads % g == 0]
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                          f"{groups}: each K/V head serves a whole number of query heads; valid "
                          f"--num-query-groups: {', '.join(map(str, valid))}")
