"""Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` settings <->
our :class:`models.config.GPTConfig` (needs no ``transformers``).

All three are pre-RMSNorm decoders with RoPE (``rotate_half``), SwiGLU and grouped-query
attention; they differ in biases and QK-norm:

- Llama: ``attention_bias`` (q, k, v, o) and ``mlp_bias``, both or neither here
  (``--disable-bias-linear`` unless both);
- Qwen2: q, k, v biases only (``--disable-bias-linear --add-qkv-bias``);
- Qwen3: no biases, RMSNorm on q and k per head before RoPE (``--disable-bias-linear
  --qk-layernorm``); its ``attention_bias=True`` (o_proj too, MLP not) has no form here.

RoPE settings are read in both spellings real directories carry: transformers 5's
``rope_parameters`` and the older top-level ``rope_theta`` + ``rope_scaling`` (``"type"`` or
``"rope_type"``). Only the default RoPE and Llama 3.1's ``llama3`` scaling with low/high
frequency factors 1 and 4 over 8192 original positions (:mod:`models.rope`) are held; any
other setting, a sliding window, or a partial rotary factor is refused by name.
"""

from __future__ import annotations

from hybrid.hf.llama_flags import difference_line, flag_line
from models.config import GPTConfig
from models.rope import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
"""``model_type`` -> the transformers class of that family."""
FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "query_groups": "--num-query-groups",
    "head_dim": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (or --tokenizer-model)",
    "max_position_embeddings": "--max-position-embeddings",
    "layernorm_epsilon": "--norm-epsilon", "rotary_base": "--rotary-base",
    "use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
    "tied": "--untie-embeddings-and-output-weights (absent: tied)",
    "add_bias_linear": "--disable-bias-linear (absent: biases)",
    "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
    "position_embedding_type": "--position-embedding-type", "normalization": "--normalization",
    "swiglu": "--swiglu", "rotary_percent": "--rotary-percent",
}
"""Each compared setting -> the pretraining flag that sets ours."""
_LLAMA3 = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
           "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}


class UnsupportedHFSetting(ValueError):
    """A Hugging Face setting our model cannot hold, or ours transformers' class cannot; the
    message names it."""


def _rope(hf: dict, problems: list[str]) -> tuple[float, float | None]:
    """``(rope_theta, llama3 scaling factor or None)`` from either spelling of the RoPE config;
    what this model cannot compute (a RoPE type other than default / llama3, llama3 parameters
    other than ours, ``partial_rotary_factor`` != 1) is appended to ``problems``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} is not held here")
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        problems.append(f"rope type {kind!r} is not held here (only 'default' and 'llama3')")
        return float(theta), None
    problems += [f"llama3 rope {key}={params[key]}; this model computes {ours} only"
                 for key, ours in _LLAMA3.items()
                 if key in params and float(params[key]) != float(ours)]
    return float(theta), float(params["factor"])


def _biases(family: str, hf: dict, problems: list[str]) -> dict:
    attn, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if family == "qwen2":
        return dict(add_bias_linear=False, add_qkv_bias=True)
    if family == "qwen3" and attn:
        problems.append("Qwen3 attention_bias=True (an o_proj bias without MLP biases) has no "
                        "form here")
    elif attn != mlp:
        problems.append(f"attention_bias={attn} with mlp_bias={mlp}: biases are on every "
                        "linear layer or none here")
    return dict(add_bias_linear=attn, add_qkv_bias=False)


def _layer_problems(hf: dict) -> list[str]:
    problems = []
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=True (sliding-window attention is not held here)")
    odd = sorted({t for t in hf.get("layer_types") or [] if t != "full_attention"})
    if odd:
        problems.append(f"layer_types {odd} (only full_attention)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r} (SwiGLU needs 'silu')")
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']} (only 1)")
    return problems


def hf_settings(hf: dict, where: str = "config.json") -> dict:
    """Our settings that a Llama / Qwen2 / Qwen3 ``config.json`` describes, keyed as
    :data:`FLAGS` (``query_groups``, ``head_dim`` and ``tied`` are GPTConfig's properties).

    Raises:
        UnsupportedHFSetting: another model_type, or the settings we cannot hold, every one
            named in one message (``where: N settings are not held here: a; b``).
    """
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise UnsupportedHFSetting(f"{where}: model_type={family!r}; loadable: "
                                   f"{sorted(ARCHITECTURES) + ['gpt2']}")
    problems = _layer_problems(hf)
    theta, factor = _rope(hf, problems)
    biases = _biases(family, hf, problems)
    if len(problems) == 1:
        raise UnsupportedHFSetting(f"{where}: {problems[0]}")
    if problems:
        raise UnsupportedHFSetting(f"{where}: {len(problems)} settings are not held here: "
                                   + "; ".join(problems))
    heads = hf["num_attention_heads"]
    out = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
               num_attention_heads=heads,
               query_groups=hf.get("num_key_value_heads") or heads,
               head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
               ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
               max_position_embeddings=hf["max_position_embeddings"],
               layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), rotary_base=theta,
               use_rope_scaling=factor is not None, tied=bool(hf.get("tie_word_embeddings")),
               qk_layernorm=family == "qwen3", position_embedding_type="rope",
               normalization="RMSNorm", swiglu=True, rotary_percent=1.0)
    if factor is not None:
        out["rope_scaling_factor"] = factor
    out.update(biases)
    return out


def check_llama_config(hf: dict, config: GPTConfig, where: str = "config.json") -> None:
    """Check that a Llama / Qwen2 / Qwen3 ``config.json`` describes the model ``config``.

    Raises:
        UnsupportedHFSetting: a setting we cannot hold (named).
        ValueError: every setting that differs, one line each with the flag change that
            removes it, then the complete model flag line that reproduces ``config.json``
            (:mod:`hybrid.hf.llama_flags`).
    """
    settings = hf_settings(hf, where)
    lines = []
    for key, theirs in settings.items():
        ours = getattr(config, key)
        same = (abs(theirs - ours) <= 1e-12 * max(1.0, abs(ours)) if isinstance(theirs, float)
                else theirs == ours)
        if not same:
            lines.append("  " + difference_line(key, theirs, ours, hf["model_type"]))
    if lines:
        n = len(lines)
        raise ValueError("\n".join([
            f"{where}: this run's model differs from config.json in {n} setting"
            + ("s" * (n > 1)) + ":", *lines,
            "  the model flags that reproduce config.json (in place of --preset and the model "
            "flags given):", "  " + flag_line(settings, hf)]))


def export_family(config: GPTConfig) -> str:
    """The ``model_type`` (``llama`` / ``qwen2`` / ``qwen3``) whose class computes ``config``
    exactly.

    Raises:
        UnsupportedHFSetting: the first setting none of them holds, named with what they need.
    """
    need = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                rotary_percent=1.0)
    for key, value in need.items():
        if getattr(config, key) != value:
            raise UnsupportedHFSetting(f"{key}={getattr(config, key)!r}: Llama / Qwen2 / Qwen3 "
                                       f"need {value!r} ({FLAGS[key]})")
    bias, qkv = config.add_bias_linear, config.add_qkv_bias and not config.add_bias_linear
    if config.qk_layernorm:
        if bias or qkv:
            raise UnsupportedHFSetting("qk_layernorm with "
                                       + ("add_bias_linear" if bias else "add_qkv_bias")
                                       + ": Qwen3 (the class with QK-norm) has no MLP biases "
                                       "and no q/k/v-only biases")
        return "qwen3"
    return "qwen2" if qkv else "llama"


def llama_config_dict(config: GPTConfig, token_ids: dict[str, int] | None = None) -> dict:
    """``config.json`` of the Llama / Qwen2 / Qwen3 class that holds ``config`` exactly
    (:func:`export_family`), in transformers 5's spelling (``rope_parameters``) plus the older
    top-level ``rope_theta`` / ``rope_scaling`` that earlier readers take."""
    family = export_family(config)
    rope = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.use_rope_scaling:
        rope.update(rope_type="llama3", factor=float(config.rope_scaling_factor), **_LLAMA3)
    out = dict(model_type=family, architectures=[ARCHITECTURES[family]],
               num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
               num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.query_groups, head_dim=config.head_dim,
               intermediate_size=config.ffn_hidden_size, vocab_size=config.vocab_size,
               max_position_embeddings=config.max_position_embeddings,
               rms_norm_eps=config.layernorm_epsilon, hidden_act="silu",
               tie_word_embeddings=config.tied, attention_dropout=config.attention_dropout,
               initializer_range=config.init_method_std, rope_parameters=rope,
               rope_theta=rope["rope_theta"],
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if config.use_rope_scaling:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if family == "llama":
        out.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_layers,
                   layer_types=["full_attention"] * config.num_layers)
        if family == "qwen3":
            out["attention_bias"] = False
    out.update(token_ids or {})
    return out
