"""Block-causal attention's kernel choice on CUDA (issue 41 item 3, models.document_attention).

* ``varlen_attn``'s keywords differ by torch release (``is_causal`` in 2.9-2.10, ``window_size``
  from 2.11, ``enable_gqa`` from 2.12): the call is built from the signature, never with a
  keyword the installed torch lacks.
* Document masking with dropout, in fp32, or without varlen, on a GQA model: SDPA gets K/V
  expanded to the query heads and no ``enable_gqa`` (the memory-efficient kernel takes a mask
  but not GQA), instead of falling back to the math backend's ``[b, heads, s, s]`` fp32 scores.

On CPU the CUDA decision is taken on tensors that report ``is_cuda`` (a subclass), with torch's
kernels replaced by spies that compute the same attention; the ``gpu`` tests run the real kernels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from models.blocks import block_causal_attention
from tests.document_worlds import layout, packed_batch

varlen_module = pytest.importorskip("torch.nn.attention.varlen")  # torch >= 2.9

GQA = {"enable_gqa": True}
HEADS, GROUPS, D = 4, 2, 16


class CudaFlagged(torch.Tensor):
    """A CPU tensor that reports ``is_cuda``: the CUDA branch's decisions, computed on CPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def qkv(dtype=torch.float32, device="cpu"):
    tokens = packed_batch()
    docs, _ = layout(tokens.to(device), False)
    b, s = tokens.shape[0], tokens.shape[1] - 1
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, D, generator=g, device=device).to(dtype)
               for h in (HEADS, GROUPS, GROUPS))
    return docs, q, k, v


def reference(q, k, v, docs) -> torch.Tensor:
    """fp64 masked attention with K/V repeated per group (``[b, heads, s, d]``)."""
    n = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(n, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=docs.mask())


def varlen_of(signature: str, calls: list):
    """A CPU stand-in for ``varlen_attn`` with the keywords of one torch release; it records
    each call's keywords and K/V heads and computes causal attention per document (fp64)."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal, gqa, kw):
        calls.append(dict(kw, kv_heads=k.shape[1]))
        assert causal, "the call was not causal within each document"
        if k.shape[1] != q.shape[1]:
            assert gqa, "fewer K/V heads than query heads without enable_gqa"
            n = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(n, dim=1) for t in (k, v))
        out = torch.empty(q.shape, dtype=torch.float64)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            seg = [t[a:b].transpose(0, 1).double() for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True).transpose(0, 1)
        return out.to(q.dtype)

    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                  return_aux=None):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, False,
                   dict(is_causal=is_causal))

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                   scale=None, window_size=(-1, -1)):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                   tuple(window_size) == (-1, 0), False, dict(window_size=window_size))

    def torch_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                   scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                   block_table=None, num_splits=None):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                   tuple(window_size) == (-1, 0), enable_gqa,
                   dict(window_size=window_size, enable_gqa=enable_gqa))

    return {"2.9": torch_2_9, "2.11": torch_2_11, "2.12": torch_2_12}[signature]


@pytest.mark.parametrize("signature, want, kv_heads", [
    ("2.9", {"is_causal": True}, HEADS),  # no enable_gqa: K/V expanded first
    ("2.11", {"window_size": (-1, 0)}, HEADS),
    ("2.12", {"window_size": (-1, 0), "enable_gqa": True}, GROUPS),
])
def test_varlen_is_called_with_the_keywords_of_the_installed_torch(monkeypatch, signature, want,
                                                                   kv_heads):
    """The case that failed: ``window_size=`` and ``enable_gqa=`` passed to torch 2.9's
    ``varlen_attn(..., is_causal=False, return_aux=None)`` (TypeError before any step)."""
    calls: list = []
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_of(signature, calls))
    docs, q, k, v = qkv(torch.bfloat16)
    out = block_causal_attention(*(t.as_subclass(CudaFlagged) for t in (q, k, v)), docs, 0.0,
                                 contextlib.nullcontext(), GQA)
    assert calls == [dict(want, kv_heads=kv_heads)]
    # the stand-in's arithmetic is fp64 rounded to bf16 once: within bf16's 2^-8 relative
    torch.testing.assert_close(out.as_subclass(torch.Tensor).double(), reference(q, k, v, docs),
                               rtol=1e-2, atol=1e-2)


def test_varlen_call_reads_each_release_signature():
    from models.document_attention import varlen_call

    calls: list = []
    assert varlen_call(varlen_of("2.9", calls), gqa=False) == ({"is_causal": True}, False)
    assert varlen_call(varlen_of("2.11", calls), gqa=True) == ({"window_size": (-1, 0)}, True)
    assert varlen_call(varlen_of("2.12", calls), gqa=True) == (
        {"window_size": (-1, 0), "enable_gqa": True}, False)
    assert varlen_call(lambda q, k, v, cu_q, cu_k, max_q, max_k: q, gqa=False) is None


def sdpa_spy(monkeypatch) -> list:
    """Record the K/V heads and keywords of every SDPA call, then run torch's on plain tensors."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(dict(kv_heads=k.shape[1], enable_gqa=kw.get("enable_gqa", False),
                          masked=kw.get("attn_mask") is not None, dropout=kw.get("dropout_p", 0)))
        return real(*(t.as_subclass(torch.Tensor) for t in (q, k, v)), **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dtype, p", [(torch.float32, 0.0), (torch.bfloat16, 0.1),
                                      (torch.float32, 0.1)])
def test_masked_cuda_path_gives_sdpa_query_heads_not_enable_gqa(monkeypatch, dtype, p):
    """Dropout or fp32 on a GQA model: the masked SDPA must not ask for ``enable_gqa`` with a
    mask (the math backend's fp32 ``[b, heads, s, s]`` scores on CUDA); K/V come expanded."""
    calls = sdpa_spy(monkeypatch)
    docs, q, k, v = qkv(dtype)
    block_causal_attention(*(t.as_subclass(CudaFlagged) for t in (q, k, v)), docs, p,
                           contextlib.nullcontext(), GQA)
    assert calls == [dict(kv_heads=HEADS, enable_gqa=False, masked=True, dropout=p)]


def test_without_varlen_the_cuda_path_is_the_masked_one_with_query_heads(monkeypatch):
    """A torch without ``torch.nn.attention.varlen`` (before 2.9): the masked SDPA path, K/V
    expanded, equal to the reference (fp32 through the spy's real SDPA: 1e-6)."""
    monkeypatch.delattr(varlen_module, "varlen_attn")
    calls = sdpa_spy(monkeypatch)
    docs, q, k, v = qkv(torch.bfloat16)
    block_causal_attention(*(t.as_subclass(CudaFlagged) for t in (q, k, v)), docs, 0.0,
                           contextlib.nullcontext(), GQA)
    assert calls == [dict(kv_heads=HEADS, enable_gqa=False, masked=True, dropout=0.0)]


def test_the_cpu_path_and_its_numerics_are_unchanged(monkeypatch):
    """CPU keeps SDPA with the mask and ``enable_gqa`` (what the golden and parity tests pin);
    the expanded CUDA form gives the same values (fp32, 1e-6: one kernel, another K/V layout)."""
    calls = sdpa_spy(monkeypatch)
    docs, q, k, v = qkv()
    cpu = block_causal_attention(q, k, v, docs, 0.0, contextlib.nullcontext(), GQA)
    assert calls == [dict(kv_heads=GROUPS, enable_gqa=True, masked=True, dropout=0.0)]
    cuda = block_causal_attention(*(t.as_subclass(CudaFlagged) for t in (q, k, v)), docs, 0.0,
                                  contextlib.nullcontext(), GQA)
    torch.testing.assert_close(cuda.as_subclass(torch.Tensor), cpu, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cpu.double(), reference(q, k, v, docs), rtol=1e-5, atol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("signature", ["installed", "2.9", "2.11"])
def test_varlen_on_cuda_for_each_release_signature(monkeypatch, signature):
    """The real varlen flash kernel, called as each release's signature allows (the older ones
    emulated by wrappers around the installed function), equals the fp64 reference (bf16)."""
    real = varlen_module.varlen_attn
    if signature == "2.9":
        def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):
            return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                        window_size=(-1, 0) if is_causal else (-1, -1))
        monkeypatch.setattr(varlen_module, "varlen_attn", old)
    elif signature == "2.11":
        def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
            return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                        window_size=window_size)
        monkeypatch.setattr(varlen_module, "varlen_attn", old)
    docs, q, k, v = qkv(torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = block_causal_attention(q, k, v, docs, 0.0, contextlib.nullcontext(), GQA)
    torch.testing.assert_close(out.double(), reference(q, k, v, docs), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, p", [(torch.float32, 0.0), (torch.bfloat16, 0.1),
                                      (torch.float32, 0.1)])
def test_masked_gqa_runs_on_the_memory_efficient_kernel(dtype, p):
    """Only the memory-efficient backend allowed: the GQA document mask with dropout or in fp32
    runs (before: no kernel, the math fallback being the only one), forward and backward; with
    no dropout the fp32 result equals the fp64 reference (1e-5)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    docs, q, k, v = qkv(dtype, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = block_causal_attention(q, k, v, docs, p, contextlib.nullcontext(), GQA)
        out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    if p == 0:
        torch.testing.assert_close(out.double(), reference(q, k, v, docs), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_masked_gqa_keeps_no_score_matrix():
    """bf16, s 4096, 32 query heads over 8 groups, dropout 0.1: forward + backward allocate far
    less than one ``[b, heads, s, s]`` fp32 score matrix (2 GiB, what the math backend holds)."""
    s, heads, groups, d = 4096, 32, 8, 128
    ids = (torch.arange(s, device="cuda") // 1000).unsqueeze(0)  # documents of 1000 tokens
    from models.documents import Documents

    docs = Documents(None, ids)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for h in (heads, groups, groups))
    docs.mask()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = block_causal_attention(q, k, v, docs, 0.1, contextlib.nullcontext(), GQA)
    out.float().sum().backward()
    torch.cuda.synchronize()
    scores = heads * s * s * 4
    assert torch.cuda.max_memory_allocated() - base < scores // 4
