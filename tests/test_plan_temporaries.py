"""The planner's temporaries term (``hybrid.planner.temporaries``, issue 27 item 13), element by
element for a small GPT (s 128, b 2, h 256, 4 heads, f 1024, V 8192, t 2) counted by hand; the
dry-run tests (``tests/test_dry_run.py``, ``tests/test_llama_dry_run.py``) check the total
against the measured step peak."""

import pytest

from hybrid.planner.plan import GB, Cluster, Training, evaluate
from hybrid.planner.temporaries import temporary_bytes
from models.gpt import GPTConfig

GPT = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=8192,
                max_position_embeddings=128)
SBV_T = 128 * 2 * 4096  # logits elements per rank


def temps(**kw):
    args = dict(model=GPT, seq_length=128, micro_batch_size=2, tp=2, stage=2, activation="none",
                bytes_per_element=2)
    return temporary_bytes(**{**args, **kw})


def test_loss_forward_holds_the_logits_and_their_fp32_copy():
    assert temps()["loss_forward"] == SBV_T * (2 + 4)          # bf16 logits + fp32 upcast
    assert temps(bytes_per_element=4)["loss_forward"] == SBV_T * 4   # fp32: no upcast copy
    # padded columns are masked in the loss's own fp32 output, not in a clone (issue 37 item 2:
    # counting a clone put GPT-2 124M's plan 18% over the dry run's measured step peak)
    assert temps(real_vocab_size=8000)["loss_forward"] == SBV_T * (2 + 4)
    assert temps(real_vocab_size=8000, bytes_per_element=4)["loss_forward"] == SBV_T * 4
    full = temps(activation="full", layer_bytes=10**6)
    assert full["loss_forward"] == SBV_T * 6 - 10**6  # the recompute working set is not alive


def test_block_backward_by_hand():
    head = 4096 * 256                                    # output layer [V/t, h], ZeRO 2/3
    block = (3 * 256**2 + 3 * 256 + 256**2 + 2 * 256 * 1024 + 1024) // 2 + 2 * 256 + 4 * 256
    mlp = 2 * 128 * 2 * 512 * 2                          # GeLU: two [s, b, f/t] gradients
    scores = 4 * (4 // 2) * 128 * 128 * 2 * 2            # four [b, a/t, s, s] score gradients
    assert temps()["block_backward"] == (head + block) * 2 + mlp + scores
    assert temps(dropout=False)["block_backward"] == (head + block) * 2 + mlp
    sp = temps(activation="sp", dropout=False)["block_backward"]
    assert sp == (head + block) * 2 + max(mlp, 2 * 128 * 2 * 256 * 2)
    # stages 0/1: each gradient goes into the fp32 buffer as it arrives; tied: the head's waits
    assert temps(stage=1)["block_backward"] == (head + 1024 * 256 // 2) * 2 + mlp + scores
    # ... and none where the weight-gradient GEMMs accumulate into the fp32 buffer themselves
    assert temps(stage=1, wgrad_fused=True)["block_backward"] == head * 2 + mlp + scores
    assert temps(wgrad_fused=True) == temps()  # ZeRO 2/3 keep the blocks' 16-bit gradients
    sel = temps(activation="selective")["block_backward"]
    assert sel == temps()["block_backward"] + (4 // 2) * 128 * 128 * 2 * (2 * 2 + 1)
    t = temps()
    assert t["total"] == max(t["loss_forward"], t["block_backward"]) > 0


def test_planner_total_and_fit_include_the_temporaries():
    training = Training(seq_length=128, micro_batch_size=2, accounting="engine")
    c = evaluate(GPT, Cluster(num_gpus=8, gpus_per_node=8, reserved_bytes=0), training, 2, 2,
                 "none")
    assert c.temporaries["total"] == SBV_T * 6
    assert c.total_bytes == (c.model_states["total"] + c.activations["gpu"] + c.buffers
                             + c.temporaries["total"])
    tight = Cluster(num_gpus=8, gpus_per_node=8, reserved_bytes=0,
                    gpu_memory_bytes=(c.total_bytes - c.temporaries["total"] // 2) / GB * GB)
    assert not evaluate(GPT, tight, training, 2, 2, "none").fits


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_tp_is_refused(bad):
    with pytest.raises(ValueError, match="tp"):
        temps(tp=bad)


def test_embedding_backward_by_hand():
    """Tied: lookup gradient, the output layer's contribution and their sum, 3 V h / t; the
    blocks whose reductions wait (ZeRO 2/3: min(L blocks, 3 buckets with overlap)); less the
    activations (freed by then) and, at ZeRO 3, the two gathered blocks (released)."""
    from hybrid.planner.temporaries import embedding_backward_bytes

    vh = 4096 * 256
    block = (3 * 256**2 + 3 * 256 + 256**2 + 2 * 256 * 1024 + 1024) // 2 + 2 * 256 + 4 * 256
    assert embedding_backward_bytes(GPT, 2, 1, 2, 10**9, 1000) == 3 * vh * 2 - 1000
    assert embedding_backward_bytes(GPT, 2, 2, 2, 10**9, 0) == (3 * vh + 2 * block) * 2
    assert embedding_backward_bytes(GPT, 2, 2, 2, 1000, 0) == (3 * vh + 3000) * 2
    assert embedding_backward_bytes(GPT, 2, 2, 2, 1000, 0, overlap=False) == (3 * vh + 2000) * 2
    assert embedding_backward_bytes(GPT, 2, 3, 2, 10**9, 0) == 3 * vh * 2
    with pytest.raises(ValueError, match="tp"):
        embedding_backward_bytes(GPT, 0, 2, 2, 1000, 0)
