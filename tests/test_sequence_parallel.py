"""Sequence parallelism and selective recompute (issue 15; Korthikanti et al. 2022, arXiv
2205.05198).

One 4-rank world runs every check at tp = 4, 2 (and 1 for the bytes). Parity is against the
single-process GPT at 1e-5 in fp32 (TP and SP change only the order of the sums inside the
collectives; measured differences are ~1e-7): dropout 0 for every variant, dropout 0.1 by the
same-masks rule for SP (see ``tests/seqpar_worlds.py``), and recompute variants at dropout 0.1
against the SP run without recompute (same streams, so identical masks).

Saved-for-backward bytes per layer follow Table 2 generalised to B bytes per activation and M
per dropout-mask element (CPU keeps masks in the activation dtype, M = B = 2 in bf16):

- TP:              sbh(4B + 2M + 12B/t + (2B + M) as/(ht))  (= sbh(10 + 24/t + 5as/(ht)) at B=2,
  M=1)
- TP + SP:         sbh(16B + 2M)/t + sbh(2B + M) as/(ht)     (= sbh(34/t + 5as/(ht)))
- TP + selective:  sbh(4B + 2M + 12B/t)                      (= sbh(10 + 24/t))
- TP + SP + sel.:  sbh(16B + 2M)/t                           (= 34 sbh / t)
- full recompute:  B sbh per layer, B sbh / t with SP
"""

import pytest

from hybrid.parallel.spawn import spawn_world
from hybrid.planner.memory import layer_activation_bytes
from tests.seqpar_worlds import CFG, VARIANTS, B, S, seqpar_world

TPS = [4, 2, 1]
L, H, A = CFG["num_layers"], CFG["hidden_size"], CFG["num_attention_heads"]
SBH = S * B * H
ACT = MASK = 2  # bf16 activations, CPU dropout masks in bf16


@pytest.fixture(scope="module")
def world():
    return spawn_world(4, seqpar_world, TPS,
                       ["parity", "ledger", "saved_bytes", "seq_not_divisible"], timeout_s=120)


def formula(t: int, sp: bool, selective: bool, act: int = ACT, mask: int = MASK) -> float:
    replicated = SBH * (4 * act + 2 * mask)
    split = SBH * 12 * act
    attn = SBH * (2 * act + mask) * A * S / H
    core = 0 if selective else attn / t
    return (replicated + split) / t + core if sp else replicated + split / t + core


def test_formulas_are_table2_at_16_bit():
    # arXiv 2205.05198 Table 2 (GPT-3 175B layer: s=2048, b=1, h=12288, a=96, t=8); bytes.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert sbh * (34 / t + 5 * a * s / (h * t)) == 358_612_992
    assert sbh * 34 / t == 106_954_752
    for sp, sel, want in ((False, False, 578_813_952), (True, False, 358_612_992),
                          (False, True, 327_155_712), (True, True, 106_954_752)):
        assert layer_activation_bytes(s, b, h, a, t, sequence_parallel=sp,
                                      recompute="selective" if sel else "none") == want


@pytest.mark.parametrize("tp", [4, 2])
def test_parity_with_single_process(world, tp):
    for rank, r in enumerate(world):
        got = r[tp]["parity"]
        assert len(got) == 2 * (len(VARIANTS) + sum(sp for sp, _ in VARIANTS.values()))  # 2 stages
        for key, v in got.items():
            assert v["loss_diff"] <= 1e-5 and v["grad_diff"] <= 1e-5, (rank, key, v)
            if "pa" in key[2]:
                assert v["partitioned"] is False  # the SP slice is not partitioned again
            if "selective" in key[2]:
                assert v["stats"]["selective_recomputes"] == 2 * L  # 2 micro-batches
            if "full" in key[2]:
                assert v["stats"]["recomputes"] == 2 * L
        for stage in (0, 3):
            frac = got[(stage, 0.1, "sp")]["drop_fraction"]
            assert 0.05 < frac < 0.15  # the replayed masks really drop
            assert got[(stage, 0.1, "sp")]["streams_differ"]


@pytest.mark.parametrize("tp", [4, 2])
def test_tp_bytes_equal_with_and_without_sp(world, tp):
    """4 all-reduces vs 4 all-gathers + 4 reduce-scatters per layer (2205.05198 §4.2.2), plus the
    embedding and output layer; SP adds the backward re-gather of stored s/t inputs and the
    all-reduce of replicated parameters' gradients, reported apart."""
    ring = (tp - 1) / tp
    for r in world:
        led = r[tp]["ledger"]
        tp_bytes, sp_bytes = led["tp"]["bytes"], led["sp"]["bytes"]
        assert sp_bytes["all_gather"] + sp_bytes["reduce_scatter"] == tp_bytes["all_reduce"]
        assert led["tp"]["calls"]["all_reduce"] == 4 * L + 2
        assert led["sp"]["calls"]["all_gather"] == led["sp"]["calls"]["reduce_scatter"] == 4 * L + 2
        assert tp_bytes["all_reduce"] == (4 * L + 2) * 2 * ring * SBH * 4  # fp32 [b, s, h]
        assert sp_bytes["regather"] == (2 * L + 1) * ring * SBH * 4
        # LN1, LN2, two row biases per layer; ln_f; positions [max_pos, h]
        grad_elems = L * (4 * H + 2 * H) + 2 * H + CFG["max_position_embeddings"] * H
        assert sp_bytes["grad_all_reduce"] == 2 * ring * grad_elems * 4


@pytest.mark.parametrize("tp", TPS)
def test_saved_bytes_per_layer_against_table2_and_planner(world, tp):
    got = world[0][tp]["saved_bytes"]
    sp = tp > 1  # SP is off at tp = 1 (as Megatron-LM)
    non_layer = {False: got["tp_full"]["other"], True: got["sp_full"]["other"]}
    for name, (is_sp, sel) in {"tp": (False, False), "sp": (True, False),
                               "tp_selective": (False, True), "sp_selective": (True, True)}.items():
        measured = (got[name]["total"] - non_layer[is_sp]) / L
        assert measured == pytest.approx(formula(tp, is_sp and sp, sel), rel=0.03), name
        planned = layer_activation_bytes(S, B, H, A, tp, sequence_parallel=is_sp and sp,
                                         recompute="selective" if sel else "none",
                                         bytes_per_element=ACT, mask_bytes=MASK)
        assert measured == pytest.approx(planned, rel=0.02), name
    assert got["tp_full"]["checkpoints"] == L * ACT * SBH
    assert got["sp_full"]["checkpoints"] == L * ACT * SBH // tp
    assert got["sp_full"]["checkpoints"] == L * layer_activation_bytes(
        S, B, H, A, tp, sequence_parallel=sp, recompute="full", bytes_per_element=ACT)


def test_sequence_not_divisible_is_a_clear_error(world):
    assert "sequence length 7 is not divisible by the TP size 2" in world[0][2]["seq_not_divisible"]


def test_planner_activation_modes():
    from hybrid.planner.memory import activation_bytes
    from models.gpt import GPTConfig

    m = GPTConfig(num_layers=4, hidden_size=768, num_attention_heads=12, vocab_size=50304,
                  max_position_embeddings=1024)
    s, b, t, sbh = 1024, 8, 4, 1024 * 8 * 768
    sp_sel = activation_bytes(m, s, b, t, "sp+selective")
    assert sp_sel["layers"] == 4 * 34 * sbh // t and sp_sel["checkpoints"] == 0
    sp = activation_bytes(m, s, b, t, "sp")
    # arXiv 2205.05198 Table 2 row TP+SP, sbh(34/t + 5as/(ht)) at t = 4
    assert sp["layers"] == 4 * 179_306_496
    full_sp = activation_bytes(m, s, b, t, "full+sp+cpu")
    assert full_sp["cpu"] == 4 * 2 * sbh // t and full_sp["layers"] == 179_306_496
    assert full_sp["non_layer"] < activation_bytes(m, s, b, t, "full+pa+cpu")["non_layer"]
