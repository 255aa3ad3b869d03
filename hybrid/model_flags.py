"""Megatron-LM's model flags -> one :class:`models.config.GPTConfig`, for every command line.

``hybrid.pretrain`` (the ``ModelConfig`` section of its config tree) and ``hybrid.plan`` (its model
argument group, :func:`add_model_args`, declared by the same fields and read into the same section
by :func:`model_section`) both call :func:`resolve_model`, so ``--preset``,
``--num-query-groups``, ``--swiglu`` and the rest mean the same in both: a preset, the explicit
shape and the architecture flags over it, resolved as Megatron-LM resolves them
(``--group-query-attention``, ``--num-query-groups``, the RoPE flags), with the refusals that
need no grid.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace

from hybrid.config import ModelConfig, TrainingConfig
from hybrid.config_fields import ConfigError
from hybrid.field_flags import add_field, key_of
from models.config import GPTConfig, invalid_query_groups
from models.presets import get_preset, training_defaults

ROPE_FLAGS = ("rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling",
              "rope_scaling_factor")
ARCHITECTURE_FLAGS = ("position_embedding_type", *ROPE_FLAGS, "normalization", "swiglu",
                      "kv_channels", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                      "untie_embeddings_and_output_weights", "apply_layernorm_1p")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _architecture(m: ModelConfig, base: GPTConfig | None) -> dict:
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


def resolve_model(m: ModelConfig, vocab: int | None = None,
                  preset_flag: str = "--preset") -> GPTConfig:
    """The :class:`GPTConfig` of model section ``m``: the preset (if any), the explicit shape and
    architecture flags over it, and the vocabulary ``vocab`` (None: ``--vocab-size``, else the
    preset's, else GPT-2's 50257). ``preset_flag`` names the preset flag in messages.

    Raises:
        ConfigError: an unknown preset, missing shape flags, a RoPE flag without RoPE, query
            groups that do not divide the heads, or a shape GPTConfig refuses (named).
    """
    try:
        base = get_preset(m.preset) if m.preset else None
    except KeyError as e:
        raise ConfigError(f"{preset_flag}: {e.args[0]}") from None
    required = ("num_layers", "hidden_size", "num_attention_heads")
    dims = {k: getattr(m, k) for k in (*required, "ffn_hidden_size")}
    if base is None:
        missing = [f"--{k.replace('_', '-')}" for k in required if dims[k] is None]
        if missing:
            raise ConfigError(f"give {preset_flag} or all of {', '.join(missing)}")
    overrides = {k: v for k, v in dims.items() if v is not None}
    overrides.update(_architecture(m, base))
    reshaped = base is not None and ("hidden_size" in overrides
                                     or overrides.get("swiglu", base.swiglu) != base.swiglu)
    if reshaped and "ffn_hidden_size" not in overrides:
        overrides["ffn_hidden_size"] = None  # Megatron's default width for the new shape
    max_pos = m.max_position_embeddings or (
        max(base.max_position_embeddings, m.seq_length) if base is not None else m.seq_length)
    common = dict(max_position_embeddings=max_pos,
                  hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                  init_method_std=m.init_method_std, layernorm_epsilon=m.layernorm_epsilon)
    if vocab or m.vocab_size:
        common["vocab_size"] = vocab or m.vocab_size
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
    if groups is not None and (valid := invalid_query_groups(heads, groups)):
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                          f"{groups}: each K/V head serves a whole number of query heads; valid "
                          f"--num-query-groups: {', '.join(map(str, valid))}")


# ----------------------------------------------------------------- hybrid.plan's flags

_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")

PLAN_MODEL_FIELDS = ("preset", "num_layers", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "vocab_size", "seq_length", "max_position_embeddings",
                     "untie_embeddings_and_output_weights", "position_embedding_type",
                     "normalization", "swiglu", "group_query_attention", "num_query_groups",
                     "kv_channels", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                     "hidden_dropout", "attention_dropout")
"""The :class:`ModelConfig` fields whose flags ``hybrid.plan`` takes (its model group)."""

_PLAN_DEFAULTS = {
    "seq_length": "the --model preset's own (GPT-3's 2048, Llama 3's 8192: "
                  "models.presets.training_defaults), else 1024",
    "hidden_dropout": "the --model preset's own (a Llama preset's 0), else Megatron-LM's 0.1; 0 "
                      "with --attention-dropout 0: no masks, SDPA attention",
    "attention_dropout": "the --model preset's own (a Llama preset's 0), else Megatron-LM's 0.1",
    "vocab_size": "the preset's, else GPT-2's 50257",
}
"""``hybrid.plan``'s defaults where its model flags differ from ``hybrid.pretrain``'s (the
training recipe a preset carries, :func:`apply_preset_defaults`; the vocabulary without a
tokenizer)."""


def _plan_reading(f) -> dict:
    """What ``hybrid.plan`` changes of field ``f``'s flag (:func:`hybrid.field_flags.add_field`):
    ``--model`` is its name for ``--preset``; ``--max-model`` searches the layer count; the
    sequence length and dropouts default to the preset's recipe (None until
    :func:`apply_preset_defaults`), the vocabulary to the preset's (:func:`resolve_model`)."""
    if f.name == "preset":
        return dict(flags=("--model",), dest="model")
    if f.name == "num_layers":
        return dict(help=f"{f.metadata['help']} (--max-model: searched)")
    if f.name in _PLAN_DEFAULTS:
        reading = dict(help=f"{f.metadata['help'].split(' (default')[0]} (hybrid.plan's "
                            f"default: {_PLAN_DEFAULTS[f.name]})")
        return reading | (dict(default=None) if f.name in MEGATRON_DEFAULTS else {})
    return {}


def add_model_args(g) -> None:
    """``hybrid.plan``'s model flags: :data:`PLAN_MODEL_FIELDS` of ``hybrid.pretrain``'s
    :class:`ModelConfig`, declared by their fields (:func:`_plan_reading` says what differs)."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for name in PLAN_MODEL_FIELDS:
        add_field(g, fields[name], **_plan_reading(fields[name]))


MEGATRON_DEFAULTS = {
    **{f.name: f.default for f in dataclasses.fields(ModelConfig)
       if f.name in ("seq_length", "hidden_dropout", "attention_dropout")},
    "global_batch_size": next(f.default for f in dataclasses.fields(TrainingConfig)
                              if f.name == "global_batch_size")}
"""``hybrid.plan``'s defaults for the training settings a preset may carry: ``hybrid.pretrain``'s
field defaults (Megatron-LM's: 1024 tokens, 0.1 dropout; no global batch: the planner's is then
micro-batch x GPUs)."""


def apply_preset_defaults(args: argparse.Namespace) -> dict:
    """Fill ``hybrid.plan``'s ``--seq-length``, ``--hidden-dropout``, ``--attention-dropout``
    and ``--global-batch-size`` left unset: the ``--model`` preset's own
    (:func:`models.presets.training_defaults`) where it has them, else
    :data:`MEGATRON_DEFAULTS`. Returns ``{flag: value}`` of those taken from the preset, for the
    planner's header (an unknown preset takes none; resolve_model names it)."""
    try:
        own = training_defaults(args.model) if args.model else {}
    except KeyError:
        own = {}
    taken = {}
    for name, default in MEGATRON_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, own.get(name, default))
            if name in own:
                taken[_flag(name)] = own[name]
    return taken


def model_from_args(args: argparse.Namespace, required: bool) -> GPTConfig | None:
    """The model of ``hybrid.plan``'s flags (:func:`add_model_args`) through
    :func:`resolve_model`; None when no model is given and ``required`` is False (``--max-model``
    over model states only); a missing ``--num-layers`` then is 1 (``--max-model`` searches it).

    Raises:
        ValueError: a non-positive dimension, missing dimensions, or what resolve_model refuses.
    """
    given = {d: getattr(args, d) for d in _DIMS if getattr(args, d) is not None}
    for name, value in given.items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    layers = args.num_layers
    if not args.model:
        missing = [d for d in ("num_layers", "hidden_size", "num_attention_heads")
                   if d not in given]
        if missing and not required and len(missing) == 3:
            return None
        if not required and missing == ["num_layers"]:
            layers, missing = 1, []
        if missing:
            raise ValueError(
                "give --model or " + ", ".join(f"--{d.replace('_', '-')}" for d in missing)
            )
    return resolve_model(model_section(args, layers), preset_flag="--model")


def model_section(args: argparse.Namespace, num_layers: int | None) -> ModelConfig:
    """``hybrid.plan``'s model flags as ``hybrid.pretrain``'s :class:`ModelConfig` section."""
    given = {f.name: getattr(args, key_of(f)) for f in dataclasses.fields(ModelConfig)
             if f.name in PLAN_MODEL_FIELDS and f.name != "preset"}  # --model
    return ModelConfig(**{**given, "preset": args.model, "num_layers": num_layers})
