"""What a Llama / Qwen2 / Qwen3 ``config.json`` asks of ``hybrid.pretrain``'s flags: every
difference from the run's model at once (one line each, with the flag change that removes it),
the complete model flag line that reproduces the config, and the dropout note.

The settings compared are :func:`hybrid.hf.llama_config.hf_settings`'s (our field names); this
module only words them. Dropout is not a difference: Megatron-LM's ``--attention-dropout`` and
``--hidden-dropout`` default to 0.1 and keep that meaning here, so a run that continues a model
whose config.json says 0 gets a note (:func:`dropout_note`), not a refusal.
"""

from __future__ import annotations

import json

from models.config import GPTConfig

_VALUE_FLAGS = {  # our field -> (config.json's name, the flag that sets ours)
    "num_layers": ("num_hidden_layers", "--num-layers"),
    "hidden_size": ("hidden_size", "--hidden-size"),
    "num_attention_heads": ("num_attention_heads", "--num-attention-heads"),
    "query_groups": ("num_key_value_heads", "--group-query-attention --num-query-groups"),
    "head_dim": ("head_dim", "--kv-channels"),
    "ffn_hidden_size": ("intermediate_size", "--ffn-hidden-size"),
    "vocab_size": ("vocab_size", "--vocab-size"),
    "max_position_embeddings": ("max_position_embeddings", "--max-position-embeddings"),
    "layernorm_epsilon": ("rms_norm_eps", "--norm-epsilon"),
    "rotary_base": ("rope_theta", "--rotary-base"),
    "rope_scaling_factor": ("the llama3 rope factor", "--rope-scaling-factor"),
    "position_embedding_type": (None, "--position-embedding-type"),
    "normalization": (None, "--normalization"),
    "rotary_percent": (None, "--rotary-percent"),
}
_SWITCHES = {  # our field -> (the flag, True when the flag gives the field's True, its negation)
    "tied": ("--untie-embeddings-and-output-weights", False,
             "--no-untie-embeddings-and-output-weights"),
    "add_bias_linear": ("--disable-bias-linear", False, "--add-bias-linear"),
    "add_qkv_bias": ("--add-qkv-bias", True, "--no-add-qkv-bias"),
    "qk_layernorm": ("--qk-layernorm", True, "--no-qk-layernorm"),
    "swiglu": ("--swiglu", True, "--no-swiglu"),
    "use_rope_scaling": ("--use-rope-scaling", True, "--no-use-rope-scaling"),
}


def _value(key: str, v) -> str:
    """A setting as its flag takes it: ``--rotary-base`` is an integer, booleans as JSON."""
    if isinstance(v, bool):
        return json.dumps(v)
    if key == "rotary_base" and float(v).is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


def _switch_text(key: str, theirs: bool, family: str) -> str:
    """What config.json says about an on/off setting, in its own words."""
    if key == "tied":
        return f"tie_word_embeddings {_value(key, theirs)} ({'tied' if theirs else 'untied'})"
    if key == "add_bias_linear":
        return (f"attention_bias and mlp_bias {_value(key, theirs)}" if family == "llama"
                else f"model_type {family} (no bias on o_proj and the MLP)")
    if key == "add_qkv_bias":
        return f"model_type {family} ({'q/k/v biases' if theirs else 'no q/k/v-only biases'})"
    if key == "qk_layernorm":
        return f"model_type {family} ({'q/k norms' if theirs else 'no q/k norms'})"
    if key == "use_rope_scaling":
        return f"rope_type {'llama3' if theirs else 'default'}"
    return "hidden_act silu (SwiGLU)"


def difference_line(key: str, theirs, ours, family: str) -> str:
    """One difference between config.json's setting ``theirs`` and this run's ``ours``: what
    config.json has and the flag change that makes the run match it."""
    if key in _SWITCHES:
        flag, gives_true, negation = _SWITCHES[key]
        text = _switch_text(key, theirs, family)
        if theirs == gives_true:
            return f"config.json has {text}: add {flag}"
        return f"config.json has {text}: drop {flag} (over a --preset: give {negation})"
    name, flag = _VALUE_FLAGS[key]
    name = name or f"model_type {family}, so {key}"
    return (f"config.json has {name} {_value(key, theirs)}, this run {_value(key, ours)}: give "
            f"{flag} {_value(key, theirs)}")


def flag_line(settings: dict, hf: dict) -> str:
    """The model flags that reproduce ``settings`` (:func:`hf_settings` of config.json ``hf``),
    dropout included: config.json's ``attention_dropout`` and no hidden dropout (these classes
    have none)."""
    s, heads = settings, settings["num_attention_heads"]
    out = [f"--num-layers {s['num_layers']}", f"--hidden-size {s['hidden_size']}",
           f"--num-attention-heads {heads}"]
    if s["query_groups"] != heads:
        out.append(f"--group-query-attention --num-query-groups {s['query_groups']}")
    if s["head_dim"] != s["hidden_size"] // heads:
        out.append(f"--kv-channels {s['head_dim']}")
    out += [f"--ffn-hidden-size {s['ffn_hidden_size']}", "--swiglu", "--normalization RMSNorm",
            f"--norm-epsilon {_value('', float(s['layernorm_epsilon']))}",
            "--position-embedding-type rope",
            f"--rotary-base {_value('rotary_base', s['rotary_base'])}"]
    if s["use_rope_scaling"]:
        out.append(f"--use-rope-scaling --rope-scaling-factor {s['rope_scaling_factor']!r}")
    out += [f"--max-position-embeddings {s['max_position_embeddings']}",
            f"--vocab-size {s['vocab_size']}"]
    out += [flag for key, flag in (("add_bias_linear", "--disable-bias-linear"),
                                   ("add_qkv_bias", "--add-qkv-bias"),
                                   ("qk_layernorm", "--qk-layernorm"),
                                   ("tied", "--untie-embeddings-and-output-weights"))
            if s[key] == (key in ("add_qkv_bias", "qk_layernorm"))]
    out.append(f"--attention-dropout {float(hf.get('attention_dropout') or 0.0)!r} "
               "--hidden-dropout 0.0")
    return " ".join(out)


def dropout_note(hf: dict, config: GPTConfig) -> str | None:
    """A line for the run's start when its dropout differs from config.json's (its
    ``attention_dropout``; no hidden dropout: these classes have none); None when equal."""
    attention = float(hf.get("attention_dropout") or 0.0)
    if config.attention_dropout == attention and config.hidden_dropout == 0.0:
        return None
    defaults = (" (Megatron-LM's defaults)" if (config.attention_dropout,
                                                 config.hidden_dropout) == (0.1, 0.1) else "")
    return (f"hybrid-pretrain: note: this run trains with --attention-dropout "
            f"{config.attention_dropout!r} --hidden-dropout {config.hidden_dropout!r}{defaults}, "
            f"while config.json has attention_dropout {attention!r} and no hidden dropout "
            "(Megatron-LM's Llama scripts train with 0 and 0): give "
            f"--attention-dropout {attention!r} --hidden-dropout 0.0 to match config.json")
