"""Named model sizes: GPTs from the GPT-2, GPT-3, Megatron-LM and ZeRO papers, and the Llama
family as Meta published it.

``get_preset(name)`` returns a fresh :class:`models.gpt.GPTConfig`; keyword overrides replace
fields (``get_preset("gpt2-124m", hidden_dropout=0.0)``).

Notes on the sources:
- GPT-3 (Brown et al. 2020, Table 2.1) lists 24 heads for the 1.3B model and d_model 5140 for
  13B; neither divides evenly, so we use 16 heads (head dim 128) and 5120 (40 heads of 128), as
  Megatron-LM's and NeMo's GPT-3 recipes do.
- Megatron-LM 8.3B: 72 layers, h 3072, 24 heads (Megatron-LM Table 2), GPT-2 vocab, seq 1024.
- ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054 Table 4): GPT-2 vocabulary and sequence 1024,
  head dim 128. The 40B row is printed with h = 4096, which gives only 17.7B parameters at 88
  layers; h = 6144 gives 39.9B, so that is what ``zero-40b`` uses. 100/125/150 layers at 8192
  are the 80B/100B/120B sizes; 175 and 212 layers are 140B and 170B.
- Llama 2 (Touvron et al. 2023, arXiv 2307.09288 Table 1 and the released config.json): 7B is
  32 layers, h 4096, 32 heads (multi-head), SwiGLU width 11008, context 4096, RoPE base 10^4,
  RMSNorm eps 1e-5, vocabulary 32000, untied output.
- Llama 3 / 3.1 (Llama 3 Herd of Models, arXiv 2407.21783 Table 3 and the released configs):
  8B 32 x 4096, 32 heads, 8 K/V heads, SwiGLU 14336; 70B 80 x 8192, 64 heads, 8 K/V heads,
  28672; 405B 126 x 16384, 128 heads, 8 K/V heads, 53248. RoPE base 500000, vocabulary 128256,
  untied; Llama 3 has an 8192 context, 3.1 131072 with the Llama 3.1 RoPE scaling (factor 8).
- ``llama-125m`` is not published: a GPT-3-Small-sized (12 x 768) model of the Llama 3 shape
  (12 heads, 4 K/V heads, Megatron's SwiGLU width 2048, Llama 2 vocabulary), for quick runs.
"""

from __future__ import annotations

import difflib
from dataclasses import replace

from models.gpt import GPTConfig

GPT2_VOCAB = 50257

# name: (num_layers, hidden_size, num_attention_heads, max_position_embeddings)
_SIZES: dict[str, tuple[int, int, int, int]] = {
    "gpt2-124m": (12, 768, 12, 1024),
    "gpt2-355m": (24, 1024, 16, 1024),
    "gpt2-774m": (36, 1280, 20, 1024),
    "gpt2-1.5b": (48, 1600, 25, 1024),
    "gpt3-125m": (12, 768, 12, 2048),
    "gpt3-350m": (24, 1024, 16, 2048),
    "gpt3-760m": (24, 1536, 16, 2048),
    "gpt3-1.3b": (24, 2048, 16, 2048),
    "gpt3-2.7b": (32, 2560, 32, 2048),
    "gpt3-6.7b": (32, 4096, 32, 2048),
    "gpt3-13b": (40, 5120, 40, 2048),
    "gpt3-175b": (96, 12288, 96, 2048),
    "megatron-1.2b": (40, 1536, 16, 1024),
    "megatron-2.5b": (54, 1920, 20, 1024),
    "megatron-4.2b": (64, 2304, 24, 1024),
    "megatron-8.3b": (72, 3072, 24, 1024),
    "zero-1.5b": (48, 1600, 16, 1024),
    "zero-8b": (72, 3072, 24, 1024),
    "zero-13b": (62, 4096, 32, 1024),
    "zero-40b": (88, 6144, 48, 1024),
    "zero-60b": (75, 8192, 64, 1024),
    "zero-80b": (100, 8192, 64, 1024),
    "zero-100b": (125, 8192, 64, 1024),
    "zero-120b": (150, 8192, 64, 1024),
    "zero-140b": (175, 8192, 64, 1024),
    "zero-170b": (212, 8192, 64, 1024),
}


_LLAMA_COMMON = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True,
                     layernorm_epsilon=1e-5, rotary_base=500000)
# name: GPTConfig fields on top of _LLAMA_COMMON
_LLAMA: dict[str, dict] = {
    "llama-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12,
                       num_query_groups=4, ffn_hidden_size=2048, vocab_size=32000,
                       max_position_embeddings=2048),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=11008, vocab_size=32000, max_position_embeddings=4096,
                      rotary_base=10000),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                      max_position_embeddings=8192),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
                       max_position_embeddings=8192),
    "llama3.1-405b": dict(num_layers=126, hidden_size=16384, num_attention_heads=128,
                          num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256,
                          max_position_embeddings=131072, use_rope_scaling=True,
                          rope_scaling_factor=8.0),
}


_LLAMA_SEQ = {"llama-125m": 2048, "llama2-7b": 4096, "llama3-8b": 8192, "llama3-70b": 8192,
              "llama3.1-405b": 8192}
"""Each Llama preset's pretraining sequence length (Llama 3.1 pretrained at 8192 and extended
its context to 131072 only at the end, arXiv 2407.21783 §3.4)."""


_RECIPE_BATCH = {"zero-100b": 1600}
"""Global batch (sequences per step) of the presets whose training run this repository
carries: ``zero-100b`` is the ZeRO paper's 100B model on 400 GPUs (arXiv 1910.02054 §10.2),
1600 sequences of 1024 tokens (1.6M tokens per step) as ``scripts/pretrain_gpt_100b_400gpu.slurm``
trains it."""


def training_defaults(name: str) -> dict:
    """The training settings preset ``name`` was published with, where it has them:
    ``seq_length`` (the GPT presets' context, the Llama presets' pretraining sequence), for
    the Llama family (no dropout in its recipe) ``hidden_dropout`` and ``attention_dropout``
    0, and ``global_batch_size`` where its run's recipe gives one (:data:`_RECIPE_BATCH`).
    ``hybrid.plan --model`` takes them as its defaults.

    Raises:
        KeyError: ``name`` is not a preset.
    """
    key = name.lower()
    if key in _LLAMA:
        return dict(seq_length=_LLAMA_SEQ[key], hidden_dropout=0.0, attention_dropout=0.0)
    out = dict(seq_length=get_preset(key).max_position_embeddings)
    if key in _RECIPE_BATCH:
        out["global_batch_size"] = _RECIPE_BATCH[key]
    return out


def list_presets() -> list[str]:
    """All preset names, smallest family first (GPTs, then the Llama family)."""
    return [*_SIZES, *_LLAMA]


def preset_table() -> str:
    """One line per preset (:func:`list_presets` order): name, layers, hidden size, attention
    heads (and K/V heads when grouped) and the exact parameter count
    (:meth:`GPTConfig.num_parameters`, in billions), under a header line."""
    rows = [f"{'preset':<16}{'layers':>7}{'hidden':>8}{'heads':>8}{'params':>10}"]
    for name in list_presets():
        c = get_preset(name)
        heads = str(c.num_attention_heads)
        if c.query_groups != c.num_attention_heads:
            heads += f"/{c.query_groups}"
        rows.append(f"{name:<16}{c.num_layers:>7}{c.hidden_size:>8}{heads:>8}"
                    f"{c.num_parameters() / 1e9:>9.3f}B")
    return "\n".join(rows)


def get_preset(name: str, **overrides) -> GPTConfig:
    """Return the :class:`GPTConfig` of preset ``name`` with ``overrides`` applied.

    Raises:
        KeyError: ``name`` is not a preset; the message suggests the closest name (difflib)
            and lists the valid names.
    """
    key = name.lower()
    if key in _LLAMA:
        config = GPTConfig(**dict(_LLAMA_COMMON, **_LLAMA[key]))
        return replace(config, **overrides) if overrides else config
    if key not in _SIZES:
        close = difflib.get_close_matches(key, list_presets(), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown model preset {name!r}{hint}; valid presets: "
                       f"{', '.join(list_presets())}")
    layers, hidden, heads, positions = _SIZES[key]
    config = GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=GPT2_VOCAB,
        max_position_embeddings=positions,
    )
    return replace(config, **overrides) if overrides else config
