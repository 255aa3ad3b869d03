"""GPU memory of P_a and the checkpoint arena (issue 5, GPU part): the measurement of
``scripts/gpu_activation_memory.py`` at a size that shows it. Skipped without CUDA; a CPU smoke
run of the same script code (no memory figures) keeps it from rotting."""

import pytest
import torch

from scripts.gpu_activation_memory import OPTIONS, report, run


def test_script_runs_on_cpu():
    res = run(num_layers=2, hidden_size=32, heads=4, seq_length=8, micro_batch_size=2,
              micro_batches=1, vocab_size=101, device="cpu")  # CPU even on a GPU host
    assert set(OPTIONS) <= set(res)
    # fp32 on CPU: 2 blocks x 4 bytes x s*b*h, halved by P_a at tp = 2.
    assert res["checkpoint"]["saved"]["checkpoints"] == 2 * 4 * 8 * 2 * 32
    assert res["Pa"]["saved"]["checkpoints"] == 2 * 4 * 8 * 2 * 32 // 2
    assert res["Pa + cpu"]["saved"]["checkpoints_host"] == 2 * 4 * 8 * 2 * 32 // 2
    assert "Pa saves" in report(res)
    # dropout 0.1: recompute replays the masks, so every option gives the same gradients
    for name in OPTIONS:
        assert res[name]["grad_norms"] == res["no checkpointing"]["grad_norms"], name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pa_and_arena_memory_on_gpu():
    res = run(num_layers=12, hidden_size=1024, heads=16, seq_length=1024, micro_batch_size=8,
              micro_batches=2)
    print(report(res))
    saving = res["checkpoint"]["peak_allocated"] - res["Pa"]["peak_allocated"]
    assert saving >= 0.5 * res["_expected_pa_saving"], report(res)
    ckpt = res["checkpoint"]["saved"]["checkpoints"]
    assert res["Pa"]["saved"]["checkpoints"] == pytest.approx(ckpt / 2, rel=0.10)
    assert res["Pa + cpu"]["saved"]["checkpoints"] == 0
    assert res["Pa + arena"]["arena_bytes"] == pytest.approx(ckpt / 2, rel=0.10)
    assert res["no checkpointing"]["peak_allocated"] > res["checkpoint"]["peak_allocated"]
    # the host copy moves the 1/t checkpoints off the device: the peak drops by about that much
    offloaded = res["Pa"]["peak_allocated"] - res["Pa + cpu"]["peak_allocated"]
    assert offloaded >= 0.5 * res["Pa"]["saved"]["checkpoints"], report(res)
    # the arena's point is fragmentation: no more reserved-but-unused memory than without it
    assert (res["checkpoint + arena"]["reserved_minus_allocated"]
            <= res["checkpoint"]["reserved_minus_allocated"] + 2**20 * 64), report(res)
    # dropout 0.1 in bf16: recompute replays the masks and kernels; the gradients agree
    ref = res["no checkpointing"]["grad_norms"]
    for name in OPTIONS:
        assert res[name]["grad_norms"] == pytest.approx(ref, rel=1e-2), name
