"""The planner knows ZeRO++ (issue 34 item 2): hpZ's secondary shard in memory, its backward
gathers inside the node (bytes and seconds), qwZ's int8 gathers, and the refusal where tp fills
the node (single process, fast). The engine side of the same numbers:
``tests/test_plan_vs_engine.py`` (the ``hpz2`` / ``qwz`` runs) and ``tests/test_zeropp.py``."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid.planner import plan
from hybrid.planner.step_time import UnitSeconds, backward_pass
from hybrid.planner.zeropp import QWZ_BYTES
from models.config import GPTConfig

MODEL = GPTConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                  max_position_embeddings=2048)
CLUSTER = plan.Cluster(num_gpus=32, gpus_per_node=8)
TRAIN = plan.Training(seq_length=2048, micro_batch_size=1, global_batch_size=64,
                      accounting="engine", dropout=False)


def _zero(**kw) -> plan.Training:
    """TRAIN with these ZeroConfig fields (at stage 3, where ZeRO++ applies)."""
    return dataclasses.replace(TRAIN, zero=dataclasses.replace(TRAIN.zero, stage=3, **kw))


def _eval(tp=2, stage=3, **kw):
    return plan.evaluate(MODEL, CLUSTER, _zero(**kw), tp, stage, "full")


def test_hpz_memory_and_inter_node_bytes():
    z3, hpz = _eval(), _eval(hpz_partition_size=4)
    psi, m, dp, p = z3.params_per_rank, z3.micro_batches, z3.dp, 2  # bf16 parameters
    assert hpz.model_states["params"] - z3.model_states["params"] == -(-psi // 4) * p
    assert z3.inter_node_dp_bytes == z3.dp_bytes  # the dp group spans the 4 nodes
    gathers = m * psi * p * (dp - 1) / dp
    assert z3.dp_bytes_by_kind["all_gather"] == pytest.approx(2 * gathers)
    assert hpz.dp_bytes_by_kind["all_gather"] == pytest.approx(gathers + m * psi * p * 3 / 4)
    assert hpz.inter_node_dp_bytes == pytest.approx(z3.dp_bytes - gathers)  # backward left
    assert hpz.times["dp_s"] < z3.times["dp_s"] and hpz.times["step_s"] <= z3.times["step_s"]
    one_node = plan.evaluate(MODEL, plan.Cluster(num_gpus=8, gpus_per_node=8), TRAIN, 2, 3,
                             "full")
    assert one_node.inter_node_dp_bytes == 0.0


def test_qwz_gathers_at_int8_bytes():
    z3, q = _eval(), _eval(quantized_weights=True)
    assert q.dp_bytes_by_kind["all_gather"] == pytest.approx(
        z3.dp_bytes_by_kind["all_gather"] * QWZ_BYTES / 2)
    assert q.dp_bytes_by_kind["reduce_scatter"] == z3.dp_bytes_by_kind["reduce_scatter"]
    assert q.model_states == z3.model_states
    assert _eval(stage=2, quantized_weights=True).dp_bytes == _eval(stage=2).dp_bytes


def test_hpz_refused_where_tp_fills_the_node():
    with pytest.raises(ValueError, match="a node holds 1 data-parallel rank "):  # the run's
        _eval(tp=8, hpz_partition_size=2)
    _, skipped = plan.plan(MODEL, CLUSTER, _zero(hpz_partition_size=2),
                           tps=[8], stages=(3,), activations=("full",))
    assert skipped and "--zero-hpz-partition-size 2" in skipped[0]
    with pytest.raises(ValueError, match="qwZ replaces 16-bit parameter gathers"):  # ZeroConfig's
        _zero(precision="fp32", quantized_weights=True)


def test_backward_gathers_priced_separately():
    u = UnitSeconds(block_fwd=1.0, block_bwd=2.0, root_fwd=0.3, root_bwd=0.4, gather_block=0.5,
                    gather_root=0.2, reduce_block=0.0, reduce_tail=0.0, compute=0.0,
                    tp_exposed=0.0, tp_hidden=0.0, gather_block_bwd=3.0, gather_root_bwd=0.1)
    b = backward_pass(u, 2, gathers=True, reduces=False, overlap_comm=True)
    # head 0.4 vs block 1's gather 3.0, block 1 (2) vs block 0's gather 3.0, block 0 (2); root 0.1
    assert b["time"] == pytest.approx(3.0 + 3.0 + 2.0 + 0.1) and b["first_gather"] == 0.1


def test_verify_passes_the_flags_to_the_dry_run_at_stage_3_only():
    from types import SimpleNamespace

    from hybrid.dryrun.verify import pretrain_argv
    from hybrid.job.cli import parse_config
    from hybrid.planner import cli as plan_cli

    args = plan_cli.build_parser().parse_args(
        ["--model", "gpt2-124m", "--num-gpus", "16", "--zero-hpz-partition-size", "2",
         "--zero-quantized-weights"])
    for stage, want in ((3, (2, True)), (2, (1, False))):
        chosen = SimpleNamespace(tp=2, stage=stage, activation="full")
        cfg = parse_config(pretrain_argv(args, SimpleNamespace(vocab_size=50257), chosen, 32))
        assert (cfg.zero.hpz_partition_size, cfg.zero.quantized_weights) == want


@pytest.mark.parametrize("extra, message", [
    (["--zero-stage", "2", "--grad-reduce", "all_reduce", "--zero-quantized-gradients"],
     "--zero-quantized-gradients True (ZeroConfig.quantized_gradients): qgZ replaces the "
     "gradient reduce-scatter; --grad-reduce is all_reduce"),
    (["--zero-stage", "2", "--zero-hpz-partition-size", "2"],
     "--zero-hpz-partition-size 2 (ZeroConfig.hpz_partition_size): hpZ partitions the ZeRO-3 "
     "parameters a second time; --zero-stage is 2"),
    (["--zero-stage", "1", "--zero-stage", "2", "--zero-quantized-weights"],  # at no stage
     "qwZ quantizes the ZeRO-3 parameter gathers; --zero-stage is 2"),
    (["--zero-stage", "1", "--zero-quantized-gradients"],
     "qgZ quantizes the ZeRO-2/3 gradient reduce-scatter; --zero-stage is 1"),
    (["--tp", "1", "--tp-comm-overlap"],  # GridConfig's
     "it needs --sequence-parallel with --tensor-model-parallel-size > 1"),
])
def test_flags_the_trainer_refuses_for_the_given_layout_are_one_line_errors(capsys, extra,
                                                                              message):
    """A fixed --zero-stage / --tp that a ZeRO++ or overlap flag cannot apply to is refused
    before planning (the trainer refuses the pair; --verify would fail on it)."""
    from hybrid.planner.cli import main

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--vocab-size", "512", "--seq-length", "64", "--num-gpus", "16",
            "--gpus-per-node", "8"]
    with pytest.raises(SystemExit) as e:
        main(argv + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
