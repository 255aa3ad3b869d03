"""Attention dropout inside the fused kernel (``F.scaled_dot_product_attention(dropout_p=p)``).

Before: any attention dropout > 0 (the default 0.1) took the hand-written softmax, which keeps
the full ``[b, a, s, s]`` probabilities for backward, on GPU too. Right value: off CPU the
default config's attention calls SDPA with ``dropout_p = 0.1``, draws its mask from the dropout
module's stream (the TP rank's for the TP-region dropout, leaving the default generator alone),
and full and selective recompute replay that mask, so their gradients equal the plain model's
bit for bit. The fused kernel runs here on CPU when asked for (``kernel = "fused"``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models.blocks
from hybrid.activation.recompute import ActivationStore, CheckpointedForward
from hybrid.activation.selective import SelectiveCore
from hybrid.parallel.layers import TPRegionDropout
from hybrid.parallel.rng import RNGTracker
from models.blocks import set_attention_kernel
from models.gpt import GPT, GPTConfig

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
           max_position_embeddings=16)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def _spy(monkeypatch) -> list[float]:
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dropout_p", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(models.blocks.F, "scaled_dot_product_attention", spy)
    return calls


def test_default_config_attention_calls_sdpa_with_dropout_off_cpu(monkeypatch):
    """``auto`` is the fused kernel on any device but CPU (meta stands in for CUDA here)."""
    calls = _spy(monkeypatch)
    attn = GPT(GPTConfig(**CFG)).layers[0].attn
    assert attn.attn_dropout.p == 0.1 and attn.kernel == "auto"  # the defaults
    q, k, v = (torch.empty(2, 4, 16, 8, device="meta") for _ in range(3))
    assert attn.core(q, k, v).shape == (2, 4, 16, 8)
    assert calls == [0.1]


def test_the_fused_kernel_calls_sdpa_with_dropout_in_training_only(monkeypatch):
    calls = _spy(monkeypatch)
    model = GPT(GPTConfig(**CFG))
    set_attention_kernel(model, "fused")
    model(*_batch()).mean().backward()
    assert calls == [0.1, 0.1]
    model.eval()
    calls.clear()
    with torch.no_grad():
        model(*_batch())
    assert calls == [0.0, 0.0]
    set_attention_kernel(model, "explicit")
    model.train()
    calls.clear()
    model(*_batch())
    assert calls == []
    with pytest.raises(ValueError, match="'flash' is not one of \\('auto', 'fused', 'explicit'"):
        set_attention_kernel(model, "flash")


class _Recording(torch.nn.Module):
    """A mask-recording dropout: attention must apply it to explicit probabilities."""

    def __init__(self, p):
        super().__init__()
        self.p, self.masks = p, []

    def forward(self, x):
        out = F.dropout(x, self.p, True)
        self.masks.append(out != 0)
        return out


def test_fused_masks_are_the_explicit_paths_masks():
    """SDPA's mask comes from the same generator draws as ``nn.Dropout`` on the probabilities
    (CPU: one Bernoulli per ``[b, a, s, s]`` element), so the explicit path with the same seed
    gives the same outputs (fp32 to 1e-6: only the softmax's rounding differs)."""
    torch.manual_seed(0)
    attn = GPT(GPTConfig(**CFG)).layers[0].attn
    attn.kernel = "fused"
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    torch.manual_seed(5)
    fused = attn.core(q, k, v)
    attn.attn_dropout = _Recording(0.1)
    torch.manual_seed(5)
    explicit = attn.core(q, k, v)
    torch.testing.assert_close(fused, explicit, atol=1e-6, rtol=1e-6)
    (mask,) = attn.attn_dropout.masks
    causal = torch.ones(16, 16, dtype=torch.bool).tril().expand_as(mask)
    dropped = (causal & ~mask).sum().item() / causal.sum().item()
    assert 0.05 < dropped < 0.2  # p = 0.1 of the 272 * 8 causal positions


def _tp_model(seed: int = 0) -> tuple[GPT, RNGTracker]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    set_attention_kernel(model, "fused")
    tracker = RNGTracker(seed=3, tp_rank=0)
    for block in model.layers:
        block.attn.attn_dropout = TPRegionDropout(0.1, tracker)
    return model, tracker


def _grads(model):
    torch.manual_seed(7)
    for _ in range(2):
        model(*_batch()).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tp_dropout_draws_from_the_tp_stream_and_recompute_replays_it(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    model, tracker = _tp_model()
    attn = model.layers[0].attn
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    default_before, tp_before = torch.get_rng_state(), tracker.get_state()
    attn.core(q, k, v)
    assert torch.equal(torch.get_rng_state(), default_before)  # no draw from the default
    assert not torch.equal(tracker.get_state(), tp_before)  # the mask came from the TP stream

    ref, _ = _tp_model()
    want = _grads(ref)
    for mode in ("full", "selective"):
        model, tracker = _tp_model()
        store = ActivationStore(None, partition=False, in_cpu=False, num_slots=None,
                                tracker=tracker)
        for i, block in enumerate(model.layers):
            if mode == "full":
                block.forward = CheckpointedForward(block, i, store)
            else:
                block.attn.core = SelectiveCore(block.attn, store)
        got = _grads(model)
        assert all(torch.equal(got[n], want[n]) for n in want), mode
        counter = store.stats.recomputes if mode == "full" else store.stats.selective_recomputes
        assert counter == 4, mode
