"""Block-causal attention of packed documents (``--reset-attention-mask``): which kernel runs it.

q ``[b, heads, s, d]``, k, v ``[b, groups, s, d]`` (grouped-query attention: ``n = heads /
groups`` query heads per K/V head, Ainslie et al. 2023, arXiv 2305.13245 §2.2), each position
attending to the earlier positions of its own document (:class:`models.documents.Documents`).
The cases, and the kernel each reaches:

* **CUDA, 16-bit, no dropout, a torch with varlen attention** (``torch.nn.attention.varlen``,
  torch >= 2.9): varlen flash attention over the documents of the flattened batch, causal per
  document, no mask at all. Its causal keyword changed between releases, so the signature is
  read once (:func:`varlen_keywords`): ``is_causal=True`` (torch 2.9, 2.10), ``window_size=(-1,
  0)`` (2.11 on); ``enable_gqa=True`` where it exists (2.12 on), else K/V are expanded to the
  query heads first (exact: the same values, ``2 b s heads d`` elements more).
* **CUDA otherwise** (attention dropout, fp32, or a torch without varlen): SDPA with the ``[b, 1,
  s, s]`` boolean mask of :meth:`models.documents.Documents.mask`. Flash attention takes no
  mask, so the memory-efficient kernel is the fused one that can run it (bias, dropout, fp32
  from sm80); but its dispatch rule in torch up to 2.13 refuses K/V with fewer heads than q
  even with ``enable_gqa`` (flash and cuDNN take GQA; cuDNN only in 16-bit, and where torch
  prefers it), so a GQA call fell back to the math backend and its ``[b, heads, s, s]`` fp32
  scores (``4 b heads s^2`` bytes: 8 GiB per layer at s 8192, 32 heads, b 1).
  K/V are therefore expanded to the query heads (``[b, heads, s, d]`` each, what the math
  backend builds anyway) and SDPA is called without ``enable_gqa``: the memory-efficient kernel
  takes it.
* **CPU**: SDPA with the mask and ``enable_gqa`` as given. CPU torch has no varlen or flash
  kernel with a document structure (FlexAttention needs ``torch.compile`` and a CUDA/Triton
  backend); the mask costs ``b s^2`` bytes per forward next to the ``b heads s^2`` scores the CPU
  path keeps anyway, and its numerics are the ones the CPU tests pin.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from models.documents import Documents


@functools.cache
def varlen_keywords(fn) -> frozenset[str]:
    """The parameter names of torch's ``varlen_attn`` ``fn`` (read once per function)."""
    return frozenset(inspect.signature(fn).parameters)


def varlen_call(fn, gqa: bool) -> tuple[dict, bool] | None:
    """``(keywords, expand_kv)`` that make ``varlen_attn`` ``fn`` causal within each document:
    ``window_size=(-1, 0)`` (torch 2.11 on) or ``is_causal=True`` (2.9, 2.10), with
    ``enable_gqa=True`` for grouped-query attention where it exists (2.12 on), else
    ``expand_kv`` (K/V expanded to the query heads by the caller). None: ``fn`` has neither
    causal keyword (the masked SDPA path then runs)."""
    params = varlen_keywords(fn)
    if "window_size" in params:
        kw = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kw = {"is_causal": True}
    else:
        return None
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw, gqa and "enable_gqa" not in params


def _varlen_attn(q: torch.Tensor, p: float):
    """torch's ``varlen_attn`` when the varlen path applies (CUDA, 16-bit, no dropout), else
    None (as on a torch before 2.9, which has no ``torch.nn.attention.varlen``)."""
    if not (q.is_cuda and p == 0 and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v ``[b, groups, s, d]`` -> ``[b, heads, s, d]``: query head ``i`` gets K/V head ``i //
    (heads / groups)``, SDPA's ``enable_gqa`` rule (a copy each)."""
    n = heads // k.shape[1]
    return k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                           p: float, scope, gqa: dict) -> torch.Tensor:
    """Attention of each position to the earlier positions of its own document only.

    q ``[b, heads, s, d]``, k, v ``[b, groups, s, d]`` -> ``[b, heads, s, d]``; ``p`` the
    attention dropout drawn inside ``scope`` (see ``models.blocks.dropout_rng_scope``), ``gqa``
    ``{"enable_gqa": True}`` when ``groups < heads``. The kernel per case: the module docstring.
    """
    heads = q.shape[1]
    fn = _varlen_attn(q, p)
    call = None if fn is None else varlen_call(fn, bool(gqa))
    if call is not None:
        kw, expand = call
        if expand:
            k, v = expand_kv(k, v, heads)
        b, _, s, d = q.shape
        cu, longest = docs.cu_seqlens()
        flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
        out = fn(*flat, cu, cu, longest, longest, **kw)
        return out.view(b, s, heads, d).transpose(1, 2)
    if q.is_cuda and gqa:  # the memory-efficient kernel takes the mask, not enable_gqa with it
        k, v = expand_kv(k, v, heads)
        gqa = {}
    with scope:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(), dropout_p=p, **gqa)
