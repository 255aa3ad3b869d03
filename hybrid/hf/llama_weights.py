"""Our Llama-class tensors <-> ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
tensors (names and layouts; needs only torch).

- Names: ``wte`` is ``model.embed_tokens``, ``layers.{i}.ln1`` / ``ln2`` are
  ``input_layernorm`` / ``post_attention_layernorm``, ``attn.proj`` is ``self_attn.o_proj``,
  ``attn.q_norm`` / ``k_norm`` are ``self_attn.q_norm`` / ``k_norm``, ``mlp.gate`` / ``fc1`` /
  ``fc2`` are ``gate_proj`` / ``up_proj`` / ``down_proj``, ``ln_f`` is ``model.norm``. Both
  store linear weights ``[out, in]``: nothing is transposed.
- Our fused ``attn.qkv`` ``[(a + 2G) d, h]``, rows ``(group, [q_1 .. q_{a/G}, k, v], d)``, is
  three tensors there: ``q_proj`` ``[a d, h]`` rows ``(head, d)`` with head ``g a/G + j`` in
  group ``g`` (transformers' ``repeat_kv`` order), ``k_proj`` and ``v_proj`` ``[G d, h]``.
- RoPE: transformers' ``rotate_half`` pairs channel ``j`` with ``j + d/2``, which is our
  default layout, so q/k rows are copied as they are. Under ``--rotary-interleaved`` we pair
  ``2i`` with ``2i + 1``; the q and k rows of each head (their biases and the q/k norm weights
  too) are permuted, HF row ``j < d/2`` = our row ``2j``, HF row ``j + d/2`` = our ``2j + 1``,
  which is exact (Su et al. 2021, arXiv 2104.09864, §3.4.2: only the pairing differs).
"""

from __future__ import annotations

import re

import torch

from models.config import GPTConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {"ln1.weight": "input_layernorm.weight",
                "ln2.weight": "post_attention_layernorm.weight",
                "attn.proj.weight": "self_attn.o_proj.weight",
                "attn.proj.bias": "self_attn.o_proj.bias",
                "attn.q_norm.weight": "self_attn.q_norm.weight",
                "attn.k_norm.weight": "self_attn.k_norm.weight",
                "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.gate.bias": "mlp.gate_proj.bias",
                "mlp.fc1.weight": "mlp.up_proj.weight", "mlp.fc1.bias": "mlp.up_proj.bias",
                "mlp.fc2.weight": "mlp.down_proj.weight", "mlp.fc2.bias": "mlp.down_proj.bias"}
_TOP_NAMES = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
ROTARY_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
"""Older Llama checkpoints store RoPE's frequencies: derived, never learned."""


def hf_keys(name: str) -> list[str]:
    """The HF tensors that make our parameter ``name`` (three for ``attn.qkv``, else one).

    Raises:
        KeyError: a parameter these classes have no place for.
    """
    if name in _TOP_NAMES:
        return [_TOP_NAMES[name]]
    m = _LAYER.match(name)
    if m and m.group(2) in ("attn.qkv.weight", "attn.qkv.bias"):
        kind = m.group(2).rsplit(".", 1)[1]
        return [f"model.layers.{m.group(1)}.self_attn.{x}_proj.{kind}" for x in "qkv"]
    if m and m.group(2) in _LAYER_NAMES:
        return [f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"]
    raise KeyError(f"parameter {name!r} has no counterpart in Llama / Qwen2 / Qwen3")


def _rope_order(d: int, device) -> torch.Tensor:
    """``[d]`` our channel of each HF channel under ``--rotary-interleaved``."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2))).to(device)


def _split_qkv(t: torch.Tensor, config: GPTConfig) -> list[torch.Tensor]:
    a, g, d = config.num_attention_heads, config.query_groups, config.head_dim
    v = t.reshape(g, a // g + 2, d, *t.shape[1:])
    q = v[:, :a // g].reshape(a, d, *t.shape[1:])
    k, val = v[:, a // g], v[:, a // g + 1]
    if config.rotary_interleaved:
        order = _rope_order(d, t.device)
        q, k = q[:, order], k[:, order]
    return [x.reshape(-1, *t.shape[1:]) for x in (q, k, val)]


def to_hf(name: str, tensor: torch.Tensor, config: GPTConfig) -> list[torch.Tensor]:
    """Our full tensor ``name`` as the HF tensors of :func:`hf_keys` (same order), contiguous.
    Works on ``meta`` tensors (to size a file)."""
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        return [x.contiguous() for x in _split_qkv(tensor, config)]
    if config.rotary_interleaved and name.endswith(("q_norm.weight", "k_norm.weight")):
        return [tensor[_rope_order(config.head_dim, tensor.device)].contiguous()]
    return [tensor]


def from_hf(name: str, tensors: list[torch.Tensor], config: GPTConfig) -> torch.Tensor:
    """Inverse of :func:`to_hf`: our tensor ``name`` from the HF tensors of :func:`hf_keys`."""
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        a, g, d = config.num_attention_heads, config.query_groups, config.head_dim
        q, k, v = tensors
        rest = q.shape[1:]
        q, k, v = q.reshape(g, a // g, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(
            g, 1, d, *rest)
        if config.rotary_interleaved:
            back = torch.argsort(_rope_order(d, q.device))
            q, k = q[:, :, back], k[:, :, back]
        return torch.cat((q, k, v), dim=1).reshape(-1, *rest)
    if config.rotary_interleaved and name.endswith(("q_norm.weight", "k_norm.weight")):
        return tensors[0][torch.argsort(_rope_order(config.head_dim, tensors[0].device))]
    return tensors[0]


def parameter_names(config: GPTConfig) -> list[str]:
    """Our parameter names of a Llama-class ``config``, in ``GPT.named_parameters()`` order."""
    from models.gpt import GPT

    with torch.device("meta"):
        return [n for n, _ in GPT(config).named_parameters()]


def our_names(config: GPTConfig) -> dict[str, str]:
    """Every HF tensor key of ``config``'s model -> our parameter that holds it."""
    return {key: name for name in parameter_names(config) for key in hf_keys(name)}
