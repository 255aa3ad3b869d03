"""Our GPT (``models.gpt``) <-> Hugging Face ``GPT2LMHeadModel``: names, layouts, settings.

Needs only torch. Both models compute the same function (pre-LayerNorm blocks, learned
positions, exact GELU, scaled dot-product attention); the weights differ in three ways:

- names: ``layers.{i}.attn.qkv`` is ``transformer.h.{i}.attn.c_attn``, ``mlp.fc1`` is
  ``mlp.c_fc``, ``mlp.fc2`` is ``mlp.c_proj``, ``ln1``/``ln2`` are ``ln_1``/``ln_2``;
- GPT-2's ``Conv1D`` stores ``[in, out]`` (``y = x @ W + b``), our ``nn.Linear`` ``[out, in]``:
  every linear weight is transposed;
- our fused qkv rows are ordered ``(head, q|k|v, head_dim)`` so that a contiguous TP split
  gives whole heads; ``c_attn``'s output columns are ``(q|k|v, head, head_dim)``.

The tied output layer stays tied (``tie_word_embeddings``); the vocabulary padding of the
tensor-parallel embedding never reaches these functions (checkpoints store unpadded tensors).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from models.config import GPTConfig

# Settings of GPT2Config that our model cannot reproduce, with the value it needs.
_HF_REQUIRED = {
    "activation_function": "gelu",  # exact erf GELU; GPT-2's own "gelu_new" is the tanh form
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
# Our GPTConfig field -> GPT2Config field (same meaning).
_SHAPE_FIELDS = {
    "num_layers": "n_layer",
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "ffn_hidden_size": "n_inner",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "n_positions",
    "layernorm_epsilon": "layer_norm_epsilon",
}
_FLAGS = {  # how a user sets each of our fields on the pretraining command line
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (or --tokenizer-model)",
    "max_position_embeddings": "--max-position-embeddings",
    "layernorm_epsilon": "--norm-epsilon",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")
_LAYER_NAMES = {  # our name inside a block -> GPT-2's, and whether it is a linear weight
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True), "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True), "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}
_TOP_NAMES = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
              "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
              "lm_head.weight": "lm_head.weight"}
_HF_LAYER_NAMES = {hf: ours for ours, (hf, _) in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {hf: ours for ours, hf in _TOP_NAMES.items()}
# Non-parameter buffers some GPT-2 checkpoints carry (the causal mask); never weights.
_HF_BUFFERS = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")


class UnsupportedModelError(ValueError):
    """A model that one side's configuration cannot express; the message names the setting."""


def parameter_names(config: GPTConfig) -> list[str]:
    """Our parameter names for ``config``, in ``GPT.named_parameters()`` order."""
    names = ["wte.weight", "wpe.weight"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in _LAYER_NAMES]
    names += ["ln_f.weight", "ln_f.bias"]
    return names + ([] if config.tied else ["lm_head.weight"])


def hf_name(name: str) -> str:
    """GPT-2's name of our parameter ``name``.

    Raises:
        UnsupportedModelError: a parameter GPT-2 has no place for.
    """
    if m := _LAYER.match(name):
        if m.group(2) in _LAYER_NAMES:
            return f"transformer.h.{m.group(1)}.{_LAYER_NAMES[m.group(2)][0]}"
    elif name in _TOP_NAMES:
        return _TOP_NAMES[name]
    raise UnsupportedModelError(f"parameter {name!r} has no counterpart in GPT-2 (GPT2LMHeadModel)")


def our_name(name: str) -> str | None:
    """Our name of GPT-2's tensor ``name`` (with or without the ``transformer.`` prefix);
    None for the causal-mask buffers some checkpoints carry.

    Raises:
        UnsupportedModelError: a tensor our model has no place for.
    """
    if not name.startswith(("transformer.", "lm_head.")):
        name = "transformer." + name
    if _HF_BUFFERS.match(name):
        return None
    if m := _HF_LAYER.match(name):
        if m.group(2) in _HF_LAYER_NAMES:
            return f"layers.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"
    elif name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    raise UnsupportedModelError(f"tensor {name!r} has no counterpart in our GPT")


def _is_linear_weight(name: str) -> bool:
    m = _LAYER.match(name)
    return bool(m) and _LAYER_NAMES.get(m.group(2), ("", False))[1]


def to_hf(name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Our full (unpadded) tensor ``name`` in GPT-2's layout.

    ``qkv.weight [3h, h]`` rows ``(head, q|k|v, d)`` -> ``c_attn.weight [h, 3h]`` columns
    ``(q|k|v, head, d)``; ``qkv.bias [3h]`` likewise; other linear weights ``[out, in]`` ->
    ``[in, out]``; everything else unchanged. Works on ``meta`` tensors (to size a file).
    """
    a, d = config.num_attention_heads, config.head_dim
    if name.endswith("attn.qkv.weight"):
        tensor = tensor.view(a, 3, d, -1).transpose(0, 1).reshape(3 * a * d, -1)
    elif name.endswith("attn.qkv.bias"):
        return tensor.view(a, 3, d).transpose(0, 1).reshape(-1)
    return tensor.t() if _is_linear_weight(name) else tensor


def from_hf(name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Inverse of :func:`to_hf`: GPT-2's tensor for our parameter ``name`` in our layout."""
    a, d = config.num_attention_heads, config.head_dim
    if _is_linear_weight(name):
        tensor = tensor.t()
    if name.endswith("attn.qkv.weight"):
        return tensor.reshape(3, a, d, -1).transpose(0, 1).reshape(3 * a * d, -1)
    if name.endswith("attn.qkv.bias"):
        return tensor.reshape(3, a, d).transpose(0, 1).reshape(-1)
    return tensor


# Llama-class GPTConfig fields and the value GPT-2 has (GPT2LMHeadModel cannot express others).
_GPT2_ARCHITECTURE = {
    "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
    "num_query_groups": None, "kv_channels": None, "add_bias_linear": True,
    "add_qkv_bias": False, "qk_layernorm": False,
}


def check_gpt2_architecture(config: GPTConfig) -> None:
    """Raise :class:`UnsupportedModelError` naming each setting of ``config`` that GPT-2 cannot
    express (RoPE, RMSNorm, SwiGLU, GQA, ...), with the value GPT-2 needs."""
    def same(k, v) -> bool:  # kv_channels = h / a is GPT-2's head size spelled out
        ours = getattr(config, k)
        return ours == v or (k == "kv_channels"
                             and ours * config.num_attention_heads == config.hidden_size)

    bad = [f"{k}={getattr(config, k)!r} (GPT-2: {v!r})" for k, v in _GPT2_ARCHITECTURE.items()
           if not same(k, v)]
    if bad:
        raise UnsupportedModelError(f"GPT-2 (GPT2LMHeadModel) has no form for {', '.join(bad)}")


def gpt_config_from_metadata(model: dict) -> GPTConfig:
    """The :class:`GPTConfig` a checkpoint's ``metadata.json`` ``model`` entry describes.

    Raises:
        UnsupportedModelError: a field this code does not know (a newer model variant), named.
    """
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise UnsupportedModelError("the checkpoint's model has settings GPT-2 export does not "
                                    f"know: {unknown}")
    config = GPTConfig(**model)
    check_gpt2_architecture(config)
    return config


def hf_config_dict(config: GPTConfig, token_ids: dict[str, int] | None = None) -> dict:
    """``GPT2Config`` keyword arguments describing ``config`` exactly (plus special token ids).

    Dropouts map to ``resid_pdrop``/``embd_pdrop`` (hidden) and ``attn_pdrop``; the
    activation is the exact GELU (``"gelu"``), not GPT-2's tanh approximation.
    """
    out = {hf: getattr(config, ours) for ours, hf in _SHAPE_FIELDS.items()}
    out.update(_HF_REQUIRED, resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
               attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
               tie_word_embeddings=config.tied, architectures=["GPT2LMHeadModel"])
    # no tokenizer: GPT-2's 50256 may be outside the vocab
    out.update(bos_token_id=None, eos_token_id=None)
    out.update(token_ids or {})
    return out


def check_hf_config(hf: dict, config: GPTConfig, where: str = "config.json") -> None:
    """Check that GPT-2 settings ``hf`` (a ``config.json``) describe the model ``config``.

    Raises:
        UnsupportedModelError: not a GPT-2 model, or a setting our model cannot reproduce.
        ValueError: every setting that differs from ``config``, one line each with both values
            and the flag that sets ours, then the model flag line that reproduces ``hf``.
    """
    if hf.get("model_type") != "gpt2":
        raise UnsupportedModelError(f"{where}: model_type={hf.get('model_type')!r}; only 'gpt2' "
                                    "(GPT2LMHeadModel) models can be loaded")
    try:
        check_gpt2_architecture(config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{where}: this run's model is not GPT-2: {e}") from None
    unheld = []  # every setting our GPT cannot reproduce, named at once
    for key, need in _HF_REQUIRED.items():
        value = hf.get(key, need if key != "activation_function" else "gelu_new")
        if value != need:
            unheld.append(f"{key}={value!r}, but our GPT needs {need!r}"
                          + (" (the exact erf GELU; GPT-2's 'gelu_new' is its tanh "
                             "approximation)" if key == "activation_function" else ""))
    if unheld:
        raise UnsupportedModelError(f"{where}: {'; '.join(unheld)}")
    n_inner = hf.get("n_inner") or 4 * hf.get("n_embd", 0)
    theirs = {ours: n_inner if key == "n_inner" else hf.get(key)
              for ours, key in _SHAPE_FIELDS.items()}
    lines = [f"  config.json has {key} {theirs[ours]}, this run {getattr(config, ours)}: give "
             f"{_FLAGS[ours].split()[0]} {theirs[ours]}"
             for ours, key in _SHAPE_FIELDS.items() if not _same(theirs[ours], config, ours)]
    tied = hf.get("tie_word_embeddings", True)
    if tied != config.tied:
        lines.append(f"  config.json has tie_word_embeddings {str(tied).lower()} "
                     + ("(tied): drop --untie-embeddings-and-output-weights" if tied else
                        "(untied): add --untie-embeddings-and-output-weights"))
    if lines:
        flags = flag_line(hf)
        n = len(lines)
        raise ValueError("\n".join([
            f"{where}: this run's model differs from config.json in {n} setting"
            + "s" * (n > 1) + ":", *lines, "  the model flags that reproduce config.json (in "
            "place of --preset and the model flags given):", "  " + flags]))


def flag_line(hf: dict) -> str:
    """The model flags that reproduce GPT-2 config.json ``hf`` (shape, tying, dropout)."""
    n_inner = hf.get("n_inner") or 4 * hf.get("n_embd", 0)
    theirs = {ours: n_inner if key == "n_inner" else hf.get(key)
              for ours, key in _SHAPE_FIELDS.items()}
    flags = " ".join(f"{_FLAGS[ours].split()[0]} {theirs[ours]}" for ours in _SHAPE_FIELDS)
    flags += "" if hf.get("tie_word_embeddings", True) else " --untie-embeddings-and-output-weights"
    return flags + (f" --attention-dropout {hf.get('attn_pdrop', 0.1)} --hidden-dropout "
                    f"{hf.get('resid_pdrop', 0.1)}")


def _same(theirs, config: GPTConfig, ours: str) -> bool:
    if ours == "layernorm_epsilon":
        return theirs is not None and abs(theirs - config.layernorm_epsilon) <= 1e-12
    return theirs == getattr(config, ours)
