"""The model part of ``python -m hybrid.plan``'s command line: a preset (``--model``), its
dimensions, and the Llama-family flags with the pretraining CLI's names and resolution."""

from __future__ import annotations

import argparse
import dataclasses
import math

from hybrid.model_shape import ModelShape
from models.gpt import NORMALIZATIONS, POSITION_EMBEDDING_TYPES
from models.presets import get_preset

_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


def _finite(text: str) -> float:
    """argparse type: a float that is a number (nan and inf would pass every comparison check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_model_args(g) -> None:
    g.add_argument("--model", "--preset", dest="model",
                   help="preset name (models.presets.get_preset; --preset as in hybrid.pretrain); "
                   "dims below override")
    g.add_argument("--num-layers", type=int, help="transformer blocks (--max-model: searched)")
    g.add_argument("--hidden-size", type=int, help="model width h")
    g.add_argument("--num-attention-heads", type=int, help="tp must divide it")
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 * hidden")
    g.add_argument("--vocab-size", type=int, default=None, help="default 50257 (GPT-2)")
    g.add_argument("--seq-length", type=int, default=1024, help="tokens per sample s")
    g.add_argument("--max-position-embeddings", type=int, help="default --seq-length")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output matrix (V x h more parameters)")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                   help="rope and none have no position table (default: the preset's)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, help="default: the preset's")
    g.add_argument("--swiglu", action="store_true", default=None,
                   help="SwiGLU MLP (--ffn-hidden-size is each half)")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="K/V heads --num-query-groups (default 1)")
    g.add_argument("--num-query-groups", type=int, help="K/V heads under GQA")
    g.add_argument("--kv-channels", type=int, help="head size (default hidden / heads)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no linear biases")
    g.add_argument("--add-qkv-bias", action="store_true", default=None, help="QKV bias only")
    g.add_argument("--qk-layernorm", action="store_true", default=None, help="q/k norms")
    g.add_argument("--hidden-dropout", type=_finite, default=0.1,
                   help="0 with --attention-dropout 0: no masks, SDPA attention")
    g.add_argument("--attention-dropout", type=_finite, default=0.1, help="see --hidden-dropout")


def _load_preset(name: str) -> ModelShape:
    try:
        return ModelShape.of(get_preset(name))
    except KeyError as err:
        raise ValueError(f"--model: {err.args[0]}") from None


def model_from_args(args: argparse.Namespace, required: bool) -> ModelShape | None:
    base = _load_preset(args.model) if args.model else None
    given = {d: getattr(args, d) for d in _DIMS if getattr(args, d) is not None}
    for name, value in given.items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if base is None:
        missing = [
            d for d in ("num_layers", "hidden_size", "num_attention_heads") if d not in given
        ]
        if missing and not required and len(missing) == 3:
            return None
        if not required and missing == ["num_layers"]:
            given["num_layers"] = 1  # --max-model searches the layer count itself
            missing = []
        if missing:
            raise ValueError(
                "give --model or " + ", ".join(f"--{d.replace('_', '-')}" for d in missing)
            )
        given.setdefault("vocab_size", 50257)
        base = ModelShape(
            max_position_embeddings=args.max_position_embeddings or args.seq_length,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            **given, **_architecture(args, None),
        )
        return base
    if args.max_position_embeddings:
        given["max_position_embeddings"] = args.max_position_embeddings
    if args.untie_embeddings_and_output_weights:
        given["untie_embeddings_and_output_weights"] = True
    return dataclasses.replace(base, **given, **_architecture(args, base))


def _architecture(args: argparse.Namespace, base: ModelShape | None) -> dict:
    """The Llama-family fields given on the command line, resolved as the pretraining CLI does
    (``hybrid.job.config_checks``): GQA without ``--num-query-groups`` is G = 1."""
    out = {k: getattr(args, k) for k in ("position_embedding_type", "normalization", "swiglu",
                                          "kv_channels", "add_qkv_bias", "qk_layernorm")
           if getattr(args, k) is not None}
    if args.disable_bias_linear:
        out["add_bias_linear"] = False
    if args.group_query_attention:
        out["num_query_groups"] = args.num_query_groups or (
            base.num_query_groups if base is not None and base.num_query_groups else 1)
    elif base is not None and base.num_query_groups and args.num_query_groups:
        out["num_query_groups"] = args.num_query_groups
    if out.get("swiglu") and args.ffn_hidden_size is None and not (base and base.swiglu):
        h = args.hidden_size or (base.hidden_size if base else 0)
        out["ffn_hidden_size"] = int(4 * h * 2 / 3 / 64) * 64
    return out
