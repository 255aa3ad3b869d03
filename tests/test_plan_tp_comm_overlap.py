"""Issue 34 item 3: the planner counts the seconds ``--tp-comm-overlap``'s rings hide
(``hybrid.planner.step_time.ring_exposed``), only on sequence-parallel layouts, and ``--verify``
passes the flag to the dry run where it takes effect (single process, fast)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hybrid.dryrun.verify import pretrain_argv
from hybrid.job.cli import parse_config
from hybrid.planner import cli as plan_cli
from hybrid.planner import plan
from hybrid.planner.step_time import ring_exposed
from models.config import GPTConfig

GPT = GPTConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0)
CLUSTER = plan.Cluster(num_gpus=32, gpus_per_node=8, peak_tflops=989.0)


def _times(act: str, overlap: bool, tp: int = 4, cluster=CLUSTER) -> dict:
    t = plan.Training(seq_length=1024, micro_batch_size=2, global_batch_size=64,
                      accounting="engine", dropout=False, tp_comm_overlap=overlap)
    return plan.evaluate(GPT, cluster, t, tp, 3, act).times


def test_ring_exposes_only_what_a_chunk_transfer_takes_beyond_a_chunk_gemm():
    # tp 4: 3 transfers of unit/3 beside 4 GEMM chunks of gemm/4
    assert ring_exposed(3.0, 4.0, 4) == 0.0  # unit/3 = 1 = gemm/4: all hidden
    assert ring_exposed(4.0, 4.0, 4) == pytest.approx(3 * (4 / 3 - 1))
    assert ring_exposed(1.0, 0.0, 8) == 1.0  # no GEMM: nothing hidden
    assert ring_exposed(1.0, 0.4, 2) == pytest.approx(1 * (1.0 - 0.2))


@pytest.mark.parametrize("act", ["sp", "full+sp", "sp+selective"])
def test_rings_hide_tp_seconds_of_sequence_parallel_layouts(act):
    off, on = _times(act, False), _times(act, True)
    assert on["compute_s"] == off["compute_s"] and on["tp_s"] == off["tp_s"]
    # every TP second is exposed or hidden, with or without the rings
    assert on["tp_exposed_s"] + on["tp_hidden_s"] == pytest.approx(on["tp_s"], rel=1e-9)
    assert 0 < on["tp_ring_hidden_s"] == pytest.approx(off["tp_exposed_s"] - on["tp_exposed_s"])
    assert on["step_s"] < off["step_s"]


@pytest.mark.parametrize("act", ["none", "full"])
def test_no_effect_without_sequence_parallelism(act):
    assert _times(act, True) == _times(act, False)


def test_no_compute_to_hide_behind_leaves_every_ring_exposed():
    fast = dataclasses.replace(CLUSTER, peak_tflops=1e12)
    off, on = _times("sp", False, cluster=fast), _times("sp", True, cluster=fast)
    assert on["tp_exposed_s"] == pytest.approx(off["tp_exposed_s"], rel=1e-6)


def test_verify_passes_the_flag_to_sequence_parallel_picks_only():
    args = plan_cli.build_parser().parse_args(
        ["--model", "gpt2-124m", "--num-gpus", "16", "--tp-comm-overlap"])
    for act, tp, want in (("sp", 2, True), ("full+sp", 2, True), ("full", 2, False),
                          ("sp", 1, False)):
        argv = pretrain_argv(args, SimpleNamespace(vocab_size=50257),
                             SimpleNamespace(tp=tp, stage=3, activation=act), 32)
        assert ("--tp-comm-overlap" in argv) == want, (act, tp)
        assert parse_config(argv).grid.tp_comm_overlap == want
