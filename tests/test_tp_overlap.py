"""Tensor-parallel backward scheduling (issue 33 item 5): the column-parallel linear launches
its input-gradient all-reduce before the weight-gradient GEMM and waits after it (tp > 1
without SP); the TP-summed gradients of replicated parameters take one all-reduce per block.

One 2-rank world (gloo) runs every check. Against the paths they replace the results are equal
bit for bit (same arithmetic, only the schedule or the packing of the collective changes; with
dropout 0.1 too, same streams). Against the single-process model: fp32, 1e-5 (TP changes only
the order of the sums inside the collectives; measured differences are ~1e-7).
"""

import pytest

from hybrid.parallel.spawn import spawn_world
from tests.tp_overlap_worlds import GPT_CFG, tp_overlap_world

L = GPT_CFG["num_layers"]


@pytest.fixture(scope="module")
def world():
    return spawn_world(2, tp_overlap_world, ["order", "bitwise", "parity", "coalesce",
                                             "no_input_grad", "shared_input"],
                       timeout_s=90)


def test_input_gradient_all_reduce_overlaps_the_weight_gradient_gemm(world):
    for r in world:
        # dgrad [tokens, in], all-reduce launched, wgrad [out/tp, in], then the wait
        assert r["order"] == [("mm", (10, 6)), ("all_reduce",), ("mm", (8, 6)), ("wait",)]


def test_overlapped_linear_is_bitwise_the_copy_then_linear_path(world):
    for r in world:
        assert r["bitwise"] == {(a, b): True for a in (False, True) for b in (False, True)}


def test_no_input_gradient_no_all_reduce(world):
    for r in world:
        assert r["no_input_grad"] == (0, True)


def test_tp2_matches_the_single_process(world):
    for r in world:
        for key, (loss_diff, grad_diff) in r["parity"].items():
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (key, loss_diff, grad_diff)


def test_one_gradient_all_reduce_per_block(world):
    for r in world:
        got = r["coalesce"]
        for dropout in (0.0, 0.1):
            # GPT + SP: per block ln1 w/b, ln2 w/b, two row biases; ln_f w/b and wpe outside
            assert got[("gpt", True, dropout)] == (L + 1, 6 * L + 3, True, True)
            assert got[("gpt", False, dropout)] == (0, 0, True, True)
            # Llama + SP with q/k norms: ln1, ln2, q_norm, k_norm per block; ln_f outside
            assert got[("llama_qk", True, dropout)] == (L + 1, 4 * L + 1, True, True)
            # without SP only the q/k norms are summed (each rank normalises other heads)
            assert got[("llama_qk", False, dropout)] == (L, 2 * L, True, True)


def test_swiglu_gate_and_up_share_one_input_collective(world):
    """Megatron-LM's single fc1 of 2f rows: per block one all-gather forward and one re-gather
    and one reduce-scatter backward fewer under SP; one input-gradient all-reduce fewer without
    SP. The forward is bit for bit the two-linear path; gradients agree to fp32 rounding (the two
    input-gradient products are summed before the collective instead of after)."""
    for r in world:
        for (sp, dropout), (same_loss, calls, calls0, diff) in r["shared_input"].items():
            assert same_loss and diff <= 1e-6, (sp, dropout, diff)
            fewer = {k: calls0.get(k, 0) - calls.get(k, 0) for k in set(calls) | set(calls0)}
            if sp:
                assert fewer == {"all_gather": L, "regather": L, "reduce_scatter": L,
                                 "grad_all_reduce": 0}, fewer
            else:
                assert fewer == {"all_reduce": L}, fewer

