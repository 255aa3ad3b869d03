"""Issue 34 item 1: the planner's step time overlaps what the engine overlaps, names what stays
exposed, and searches the micro-batch size within the global batch (single process, fast)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybrid.flops import flops_per_iteration
from hybrid.parallel.vocab import pad_vocab_size
from hybrid.planner import cli as plan_cli
from hybrid.planner import plan
from hybrid.planner.step_time import (
    UnitSeconds,
    backward_pass,
    forward_pass,
    overlapped,
    step_seconds,
)
from hybrid.zero.config import ZeroConfig
from models.config import GPTConfig

U = UnitSeconds(block_fwd=1.0, block_bwd=2.0, root_fwd=0.3, root_bwd=0.4, gather_block=0.5,
                gather_root=0.2, reduce_block=1.0, reduce_tail=0.3, compute=0.0, tp_exposed=0.0,
                tp_hidden=0.0)


def test_communication_shorter_than_compute_is_hidden():
    assert overlapped([(2.0, 1.0), (2.0, 1.0)]) == (4.0, 0.0, 0.0)
    # forward, 3 blocks: g_r + g exposed, then block i hides block i+1's gather
    f = forward_pass(U, 3, gathers=True)
    assert f == pytest.approx({"time": 0.2 + 0.5 + 2 * 1.0 + 1.0 + 0.3, "first_gather": 0.7,
                               "unhidden": 0.0, "unhidden_cpu": 0.0})


def test_communication_longer_than_compute_is_exposed_beyond_it():
    assert overlapped([(1.0, 3.0)]) == (3.0, 2.0, 0.0)
    # three lanes: host copies beyond both the compute and the collectives
    assert overlapped([(1.0, 0.5, 2.0), (1.0, 0.5, 0.5)]) == (3.0, 0.0, 1.0)
    slow = dataclasses.replace(U, gather_block=1.5)
    f = forward_pass(slow, 3, gathers=True)
    # g_r + g + (N-1) max(F, g) + F + R_f = 0.2 + 1.5 + 2 * 1.5 + 1 + 0.3
    assert f == pytest.approx({"time": 6.0, "first_gather": 1.7, "unhidden": 2 * 0.5,
                               "unhidden_cpu": 0.0})


def test_backward_first_gather_and_last_reduce_are_exposed():
    b = backward_pass(U, 3, gathers=True, reduces=True, overlap_comm=True)
    # head (0.4 vs the last block's gather 0.5), block 2 (2 vs gather 0.5), block 1 (2 vs
    # gather 0.5 + block 2's reduce 1.0), block 0 (2 vs block 1's reduce 1.0); then the root's
    # re-gather 0.2 before and block 0's reduce 1.0 + the tail 0.3 after
    assert b == pytest.approx({"time": 0.5 + 2 + 2 + 2 + 0.2 + 1.3, "first_gather": 0.2,
                               "last_reduce": 1.3, "first_load": 0.0, "unhidden": 0.1,
                               "unhidden_cpu": 0.0})
    # without overlap_comm every block's reduction waits for the end of backward
    b = backward_pass(U, 3, gathers=False, reduces=True, overlap_comm=False)
    assert b["last_reduce"] == pytest.approx(3 * 1.0 + 0.3)
    assert b["time"] == pytest.approx(0.4 + 3 * 2 + 3.3)


def test_offloaded_checkpoints_hide_but_the_first_load():
    """P_a+cpu: block i's checkpoint goes to the host during its forward, block i-1's comes
    back during block i's backward; the last block's load starts each backward, exposed."""
    off = dataclasses.replace(U, offload_block=0.6)
    f = forward_pass(off, 3, gathers=False)
    assert f["time"] == pytest.approx(3 * 1.0 + 0.3) and f["unhidden_cpu"] == 0
    b = backward_pass(off, 3, gathers=False, reduces=False, overlap_comm=True)
    assert b["first_load"] == 0.6 and b["time"] == pytest.approx(0.4 + 3 * 2.0 + 0.6)
    slow = dataclasses.replace(U, offload_block=2.5)
    b = backward_pass(slow, 3, gathers=False, reduces=False, overlap_comm=True)
    assert b["unhidden_cpu"] == pytest.approx(2 * 0.5)  # blocks 2 and 1 prefetch 1 and 0


def test_stage1_reduces_in_the_last_micro_batch_and_refresh_can_be_deferred():
    kw = dict(n=3, micro_batches=2, stage=1, refresh=0.9, optimizer=0.05)
    plain = step_seconds(U, **kw)
    compute_path = 2 * (3 * 1.0 + 0.3 + 3 * 2.0 + 0.4)
    assert plain["last_reduce_s"] == pytest.approx(1.3) and plain["first_gather_s"] == 0
    assert plain["step_s"] == pytest.approx(compute_path + 1.3 + 0.9 + 0.05)
    deferred = step_seconds(U, **kw, overlap_param_gather=True)
    # the refresh moves into the first forward: root + block 0 exposed, the rest hidden
    assert deferred["refresh_s"] == 0 and deferred["first_gather_s"] == pytest.approx(0.7)
    assert deferred["step_s"] == pytest.approx(compute_path + 1.3 + 0.7 + 0.05)


GPT = GPTConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0)


def _eval(cluster, stage, act, zero=(), **training):
    """``zero``: ZeroConfig fields over bf16 with ZeroConfig's persistence threshold."""
    z = ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=100_000, **dict(zero))
    t = plan.Training(seq_length=1024, accounting="engine", dropout=False, zero=z, **training)
    return plan.evaluate(GPT, cluster, t, 2, stage, act)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("act", ["none", "full", "sp", "full+sp"])
def test_terms_add_up_and_only_hide(stage, act):
    """compute_s is the FLOPs formula; tp exposed + hidden = tp bytes / bandwidth; overlap only
    hides (the step is at most the old sum of every term)."""
    cluster = plan.Cluster(num_gpus=32, gpus_per_node=8, peak_tflops=989.0)
    c = _eval(cluster, stage, act, micro_batch_size=2, global_batch_size=64)
    t = c.times
    recompute = "full" if "full" in act else "none"
    m = dataclasses.replace(GPT, vocab_size=pad_vocab_size(32000, 2, 128))
    flops = flops_per_iteration(m, 64, 1024, recompute) / (32 * 989e12 * 0.45)
    assert t["compute_s"] == pytest.approx(flops, rel=1e-12)
    assert t["tp_exposed_s"] + t["tp_hidden_s"] == pytest.approx(t["tp_s"], rel=1e-9)
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_s"])
    assert t["step_s"] <= t["compute_s"] + t["tp_s"] + t["dp_s"] + t["optimizer_s"] + 1e-9
    assert t["dp_exposed_s"] <= t["dp_s"] + 1e-9
    # no compute to hide behind (peak ~ infinite) and no TP: the step is every byte's time
    free = plan.evaluate(GPT, dataclasses.replace(cluster, peak_tflops=1e15),
                         plan.Training(seq_length=1024, micro_batch_size=2, global_batch_size=64),
                         1, stage, "full" if "full" in act else "none").times
    assert free["step_s"] == pytest.approx(free["dp_s"] + free["optimizer_s"], rel=1e-6)


def test_zero3_gathers_hide_behind_compute_and_stage1_refresh_is_exposed():
    cluster = plan.Cluster(num_gpus=32, gpus_per_node=8, peak_tflops=989.0)
    z3 = _eval(cluster, 3, "none", micro_batch_size=2, global_batch_size=64).times
    assert z3["dp_exposed_s"] < z3["dp_s"]  # the prefetch and the overlapped reduce-scatter
    assert z3["first_gather_s"] > 0 and z3["last_reduce_s"] > 0
    z1 = _eval(cluster, 1, "none", micro_batch_size=2, global_batch_size=64).times
    assert z1["refresh_s"] > 0 and z1["first_gather_s"] == 0
    opg = _eval(cluster, 1, "none", micro_batch_size=2, global_batch_size=64,
                zero={"overlap_param_gather": True}).times
    assert opg["refresh_s"] == 0 and 0 < opg["first_gather_s"] < z1["refresh_s"]
    assert opg["step_s"] < z1["step_s"]


def test_grad_reduce_in_bf16_halves_the_gradient_bytes():
    cluster = plan.Cluster(num_gpus=32, gpus_per_node=8, peak_tflops=989.0)
    fp32 = _eval(cluster, 2, "none", micro_batch_size=2, global_batch_size=64)
    bf16 = _eval(cluster, 2, "none", micro_batch_size=2, global_batch_size=64,
                 zero={"grad_reduce_in_bf16": True})
    assert (bf16.dp_bytes_by_kind["reduce_scatter"]
            == fp32.dp_bytes_by_kind["reduce_scatter"] / 2 > 0)
    assert bf16.model_states["grads"] == fp32.model_states["grads"] / 2
    with pytest.raises(ValueError, match="bf16 gradients need bf16 training"):  # ZeroConfig's
        plan.Training(seq_length=8, zero=ZeroConfig(precision="fp32", grad_reduce_in_bf16=True))


def test_micro_batch_choices_divide_the_global_batch():
    assert plan.micro_batch_choices(1600, 50) == [1, 2, 4, 8, 16, 32]
    assert plan.micro_batch_choices(100, 8) == []


def test_search_picks_a_larger_micro_batch_when_it_fits_and_is_faster():
    """ZeRO-3 gathers the parameters twice per micro-batch: fewer, larger micro-batches cut
    that traffic, so the search picks the largest b that fits."""
    cluster = plan.Cluster(num_gpus=32, gpus_per_node=8, peak_tflops=989.0)
    t = plan.Training(seq_length=1024, global_batch_size=256, accounting="engine",
                      dropout=False)
    cands, _ = plan.plan(GPT, cluster, t, tps=[2], stages=(3,), activations=("full",),
                         search_micro_batch=True)
    by_b = {c.micro_batch_size: c for c in cands}
    assert sorted(by_b) == [1, 2, 4, 8, 16]
    chosen = plan.best(cands)
    assert chosen.micro_batch_size == 16 and chosen.micro_batches == 1
    assert chosen.times["step_s"] < by_b[1].times["step_s"]
    # a GPU too small for b = 16 gets the largest b that fits
    limit = (by_b[4].total_bytes + by_b[8].total_bytes) / 2
    small = dataclasses.replace(cluster, gpu_memory_bytes=limit)
    cands, _ = plan.plan(GPT, small, t, tps=[2], stages=(3,), activations=("full",),
                         search_micro_batch=True)
    assert plan.best(cands).micro_batch_size == 4


DIMS = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--vocab-size", "32000", "--seq-length", "1024", "--num-gpus", "32", "--device", "H100",
        "--tp", "2", "--zero-stage", "3", "--activation", "full", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def test_cli_searches_b_within_the_global_batch_and_verify_dry_runs_it(monkeypatch, capsys):
    from hybrid import plan
    from hybrid.dryrun import verify

    seen = []
    monkeypatch.setattr(verify, "verify",
                        lambda argv, say, gpu_paths: seen.append(argv) or {"stub": True})
    monkeypatch.setattr(verify, "comparison_lines", lambda *a: [])
    assert plan.main([*DIMS, "--global-batch-size", "256", "--json", "--verify"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["micro_batch_size"] for c in doc["candidates"]} == {1, 2, 4, 8, 16}
    assert doc["cluster"]["hbm_gbs"] == 3350.0  # the H100 preset's, for the optimizer step
    b = doc["best"]["micro_batch_size"]
    assert b == 16
    (argv,) = seen
    assert argv[argv.index("--micro-batch-size") + 1] == str(b)
    assert argv[argv.index("--global-batch-size") + 1] == "256"
    # a given micro-batch restricts the search; the text names the exposed seconds
    assert plan_cli.main([*DIMS, "--global-batch-size", "256", "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch=2 (m=8)" in out and "exposed s: tp " in out and "first gather" in out
