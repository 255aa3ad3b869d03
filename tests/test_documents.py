"""Document-masked packing (issue 36): ``--reset-position-ids --reset-attention-mask
--eod-mask-loss`` with Megatron-LM's meaning.

* The layout is Megatron-LM's ``_get_ltor_masks_and_position_ids``, written out per position.
* The per-token losses of a packed batch equal each document run alone through transformers'
  ``LlamaForCausalLM`` at (tp1, dp1, ZeRO-0) and (tp2, dp2, ZeRO-3) + sequence parallelism +
  selective recompute (and ZeRO-1 + SP + full recompute); with ``--eod-mask-loss`` the same at
  every unmasked position, the eod inputs masked.
* Three training steps with the loss mask and ``--calculate-per-token-loss`` equal the
  single-process model under torch AdamW.

Tolerance 1e-5 (fp32): the same arithmetic in another order (observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.hf import llama_weights as llama  # noqa: E402
from hybrid.parallel.spawn import spawn_world  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from tests.document_worlds import (  # noqa: E402
    CFG,
    EOD,
    layout,
    packed_batch,
    reference_training,
    world1,
    world4,
)
from tests.tiny import SEED  # noqa: E402


def megatron_layout(x: torch.Tensor, eod: int):
    """Megatron-LM's loop over the eod indices of one sequence (its ``_get_ltor_masks_and_
    position_ids``), as a reference: ``(allowed [s, s], loss_mask [s], position_ids [s])``."""
    s = x.numel()
    allowed = torch.tril(torch.ones(s, s))
    loss_mask = torch.ones(s)
    loss_mask[x == eod] = 0.0
    position_ids = torch.arange(s)
    prev = 0
    for i in (x == eod).nonzero().flatten().tolist():
        allowed[i + 1:, :i + 1] = 0
        position_ids[i + 1:] -= i + 1 - prev
        prev = i + 1
    return allowed.bool(), loss_mask, position_ids


def test_the_layout_is_megatrons():
    tokens = packed_batch()
    docs, mask = layout(tokens, True)
    for r in range(tokens.shape[0]):
        allowed, loss_mask, positions = megatron_layout(tokens[r, :-1], EOD)
        assert torch.equal(docs.position_ids[r], positions)
        assert torch.equal(docs.mask()[r, 0], allowed)
        assert torch.equal(mask[r], loss_mask)
    assert (tokens[:, :-1] == EOD).sum() >= 8 and mask.min() == 0


def hf_document_losses(tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: each document of each row run alone through transformers' Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = GPTConfig(**CFG)
    ours = GPT(config)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False))
    state = {k: t for n, p in ours.named_parameters()
             for k, t in zip(llama.hf_keys(n), llama.to_hf(n, p.detach(), config), strict=True)}
    hf.load_state_dict(state, strict=False)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = torch.empty(x.shape)
    with torch.no_grad():
        for r in range(x.shape[0]):
            ends = [i + 1 for i in (x[r] == EOD).nonzero().flatten().tolist()]
            for lo, hi in zip([0, *ends], [*ends, x.shape[1]], strict=True):
                if hi > lo:
                    logits = hf(x[r:r + 1, lo:hi]).logits[0]
                    out[r, lo:hi] = torch.nn.functional.cross_entropy(
                        logits, y[r, lo:hi], reduction="none")
    return out


@pytest.fixture(scope="module")
def worlds():
    out = dict(spawn_world(1, world1, timeout_s=120)[0])
    four = spawn_world(4, world4, timeout_s=240)
    for name in four[0]:
        out[name] = [r[name] for r in four]
    out["dropout"] = four[0]["dropout"]
    out["tp1_dp1_zero0"] = [out["tp1_dp1_zero0"]]
    return out


@pytest.fixture(scope="module")
def hf_losses():
    return hf_document_losses(packed_batch())


GRIDS = ["tp1_dp1_zero0", "tp2_dp2_zero3_sp_selective", "tp2_dp2_zero1_sp_full"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("eod_mask_loss", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_per_token_losses_equal_each_document_alone_in_transformers(worlds, hf_losses, grid,
                                                                    eod_mask_loss):
    _, mask = layout(packed_batch(), True)
    for rank in worlds[grid]:
        got, want = rank["per_token"], hf_losses[rank["rows"]]
        if eod_mask_loss:
            keep = mask[rank["rows"]].bool()
            assert not keep.all()
            got, want = got[keep], want[keep]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("grid", GRIDS)
def test_training_with_the_loss_mask_equals_the_single_process_model(worlds, grid):
    want = reference_training()
    got = worlds[grid][0]
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    for k, v in want["final"].items():
        torch.testing.assert_close(got["final"][k], v, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.timeout(900)
def test_with_dropout_every_zero_stage_gives_the_same_losses(worlds):
    """Dropout on (attention and hidden 0.1): ZeRO-0 and ZeRO-3 on one grid, bit for bit, and
    not the dropout-free losses."""
    d = worlds["dropout"]
    assert d[0] == d[3]
    assert d[0] != worlds["tp2_dp2_zero3_sp_selective"][0]["losses"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_flash_path_equals_the_masked_sdpa_path_on_cuda():
    """On CUDA in bf16 without dropout the block-causal core is varlen flash attention; it must
    give what SDPA with the document mask gives (bf16 tolerance 2e-2), gradients included."""
    import contextlib

    from models.blocks import block_causal_attention

    tokens = packed_batch().cuda()
    docs, _ = layout(tokens, False)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s = tokens.shape[0], tokens.shape[1] - 1
    q, k, v = (torch.randn(b, h, s, 16, device="cuda", generator=g,
                           dtype=torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    out = block_causal_attention(q, k, v, docs, 0.0, contextlib.nullcontext(),
                                 {"enable_gqa": True})
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=docs.mask(), enable_gqa=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
