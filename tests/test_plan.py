"""Memory planner against the ZeRO, Megatron and 2205.05198 numbers (arXiv 1910.02054 Tables 1-2,
1909.08053, 2205.05198 Table 2)."""

from pathlib import Path

import pytest

from hybrid import flops
from hybrid.parallel.vocab import pad_vocab_size
from hybrid.planner import max_model, plan
from hybrid.planner.memory import (
    activation_rule_of_thumb_bytes,
    checkpoint_bytes,
    comm_buffer_bytes,
    fused_buffer_bytes,
    layer_activation_bytes,
    model_state_bytes,
)
from hybrid.planner.traffic import (
    dp_traffic_bytes,
    dp_traffic_elements,
    tp_collectives_per_layer,
    tp_traffic_elements,
    vocab_parallel_cross_entropy_elements,
)
from hybrid.zero.config import ZeroConfig
from tests.test_flops import gpt

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]

# ZeRO Table 1 (arXiv 1910.02054): {Ψ: {N_d: (P_os, P_os+g, P_os+g+p)}} in GB; '*' cells fit 32 GB.
TABLE1 = {
    7.5e9: {
        1: (120, 120, 120),
        4: (52.5, 41.3, 30),
        16: (35.6, 21.6, 7.5),
        64: (31.4, 16.6, 1.88),
        256: (30.4, 15.4, 0.47),
        1024: (30.1, 15.1, 0.12),
    },
    128e9: {
        1: (2048, 2048, 2048),
        4: (896, 704, 512),
        16: (608, 368, 128),
        64: (536, 284, 32),
        256: (518, 263, 8),
        1024: (513, 257, 2),
    },
    1e12: {
        1: (16000, 16000, 16000),
        4: (7000, 5500, 4000),
        16: (4750, 2875, 1000),
        64: (4187, 2218, 250),
        256: (4046, 2054, 62.5),
        1024: (4011, 2013, 15.6),
    },
}
# The bold cell of each (model, stage) column: the smallest DP degree that fits 32 GB (None: never).
TABLE1_FIRST_FIT = {
    (7.5e9, 1): 64,
    (7.5e9, 2): 16,
    (7.5e9, 3): 4,
    (128e9, 1): None,
    (128e9, 2): None,
    (128e9, 3): 64,
    (1e12, 1): None,
    (1e12, 2): None,
    (1e12, 3): 1024,
}


# ZeRO model states: items 1, 2, 3, 5 ---------------------------------------------------------


@pytest.mark.parametrize("psi", list(TABLE1))
def test_zero_table1_all_cells(psi):
    for dp, row in TABLE1[psi].items():
        for stage, paper_gb in zip((1, 2, 3), row, strict=True):
            got = model_state_bytes(psi, tp=1, dp=dp, stage=stage)["total"] / GB
            assert abs(got - paper_gb) <= max(0.005 * paper_gb, 1.0), (
                psi,
                dp,
                stage,
                got,
                paper_gb,
            )


@pytest.mark.parametrize(("psi", "stage"), list(TABLE1_FIRST_FIT))
def test_zero_table1_bold_cells_are_the_first_fit(psi, stage):
    fitting = [dp for dp in TABLE1[psi] if model_state_bytes(psi, 1, dp, stage)["total"] <= 32 * GB]
    assert (min(fitting) if fitting else None) == TABLE1_FIRST_FIT[(psi, stage)]


def test_figure1_example_and_components():
    got = [model_state_bytes(7.5e9, 1, 64, s)["total"] / GB for s in range(4)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-9)
    s1 = model_state_bytes(7.5e9, 1, 64, 1)
    assert (s1["params"], s1["grads"]) == (15e9, 15e9)
    assert s1["master"] + s1["optimizer"] == 12 * 7.5e9 / 64


def test_tp_shard_first_then_zero():
    got = [model_state_bytes(7.5e9, tp=8, dp=8, stage=s)["total"] / GB for s in (1, 2, 3)]
    assert got == pytest.approx([5.15625, 3.515625, 1.875], rel=1e-9)


def test_exact_config_counts_replicated_parameters():
    m = gpt(32, 4096, 32, v=pad_vocab_size(50257, 8))
    exact = model_state_bytes(m, tp=8, dp=8, stage=1)["total"]
    ideal = model_state_bytes(flops.num_parameters(m), tp=8, dp=8, stage=1)["total"]
    assert ideal < exact < 1.01 * ideal


def test_mixed_precision_bookkeeping():
    states = model_state_bytes(1.5e9)
    assert states["params"] == 3.0 * GB
    assert states["total"] == 24.0 * GB
    assert fused_buffer_bytes(int(1.5e9)) == 6.0 * GB
    assert fused_buffer_bytes(int(3e9)) == 12.0 * GB


def test_fp32_counts_no_master_copy():
    states = model_state_bytes(1e9, precision="fp32")
    assert states == {"params": 4e9, "grads": 4e9, "master": 0, "optimizer": 8e9, "total": 16e9}
    assert model_state_bytes(1e9, dp=4, stage=3, precision="fp32")["total"] == 4e9


# Table 2 inversion: item 4 -------------------------------------------------------------------

TABLE2 = {
    1: (2e9, 7.6e9, 14.4e9, 128e9),
    2: (4e9, 15.2e9, 28.8e9, 256e9),
    4: (8e9, 30.4e9, 57.6e9, 0.5e12),
    8: (16e9, 60.8e9, 115.2e9, 1e12),
    16: (32e9, 121.6e9, 230.4e9, 2e12),
}


@pytest.mark.parametrize("mp", list(TABLE2))
def test_zero_table2_max_model_size(mp):
    got = [max_model.max_params(32 * GB, mp, 64, stage) for stage in range(4)]
    for stage in range(3):  # the paper rounds the MP=1 row and scales it: ~0.6%
        assert got[stage] == pytest.approx(TABLE2[mp][stage], rel=0.006)
    # The stage-3 column is 128B * MP exactly; the paper prints 512B/1024B/2048B as 0.5T/1T/2T.
    assert got[3] == 128e9 * mp
    assert got[3] == pytest.approx(TABLE2[mp][3], rel=0.025)


def test_table2_mp1_exact_values():
    got = [max_model.max_params(32 * GB, 1, 64, s) / 1e9 for s in range(4)]
    assert got == pytest.approx([2.0, 7.642, 14.423, 128.0], abs=0.001)


# activations: items 9, 10, 11, 12 ------------------------------------------------------------

GPT3_LAYER = {
    ("none", False, 1): 2_868_903_936,
    ("none", False, 8): 578_813_952,
    ("none", True, 8): 358_612_992,
    ("selective", False, 8): 327_155_712,
    ("selective", True, 8): 106_954_752,
    ("full", False, 8): 50_331_648,
}


@pytest.mark.parametrize(("key", "expected"), list(GPT3_LAYER.items()))
def test_per_layer_activation_bytes_gpt3(key, expected):
    recompute, sp, t = key
    got = layer_activation_bytes(
        2048, 1, 12288, 96, tp=t, sequence_parallel=sp, recompute=recompute
    )
    assert got == expected


@pytest.mark.parametrize(
    ("t", "sp", "expected"),
    [
        (1, False, 717_225_984),
        (2, False, 390_070_272),
        (2, True, 358_612_992),
        (4, False, 226_492_416),
        (4, True, 179_306_496),
    ],
)
def test_per_layer_activation_bytes_small(t, sp, expected):
    assert layer_activation_bytes(1024, 8, 768, 12, tp=t, sequence_parallel=sp) == expected


def test_sharded_full_recompute_checkpoint():
    assert checkpoint_bytes(1, 2048, 1, 12288, tp=8, partitioned=True) == 6_291_456


def test_selective_recompute_share():
    for a, h, saved, overhead, layers in (
        (96, 12288, 0.702, 0.027, 96),
        (128, 20480, 0.653, 0.016, 105),
    ):
        full = layer_activation_bytes(2048, 1, h, a)
        sel = layer_activation_bytes(2048, 1, h, a, recompute="selective")
        assert 1 - sel / full == pytest.approx(saved, abs=0.001)
        m = gpt(layers, h, a)
        ratio = flops.flops_per_iteration(m, 1, 2048, "selective") / flops.flops_per_iteration(
            m, 1, 2048
        )
        assert ratio - 1 == pytest.approx(overhead, abs=0.001)


def test_partitioned_checkpoints_100b():
    assert checkpoint_bytes(125, 1024, 32, 8192) / GB == pytest.approx(67.1, abs=0.05)
    assert checkpoint_bytes(125, 1024, 32, 8192, tp=16, partitioned=True) / GB == pytest.approx(
        4.19, abs=0.01
    )


def test_activation_rule_of_thumb():
    assert activation_rule_of_thumb_bytes(1600, 32, 1024, 48) / GB == pytest.approx(60.4, abs=0.05)


# communication: items 6, 7, 8, 9, 16 ---------------------------------------------------------


def test_dp_traffic_zero_section7():
    psi = 1e9
    assert [dp_traffic_elements(psi, 8, s, ring_factor=False) for s in range(4)] == [
        2e9,
        2e9,
        2e9,
        3e9,
    ]
    assert dp_traffic_elements(psi, 8, 2) == pytest.approx(1.75e9)
    assert dp_traffic_elements(psi, 8, 3) == pytest.approx(2.625e9)
    assert dp_traffic_bytes(psi, 8, 3) == pytest.approx(5.25e9)
    assert dp_traffic_bytes(psi, 8, 3, precision="fp32") == pytest.approx(10.5e9)
    assert dp_traffic_elements(psi, 1, 3) == 0
    # Accumulating 4 micro-batches: stage 1 reduces once, stage 2 each micro-batch, stage 3 all.
    assert [
        dp_traffic_elements(psi, 8, s, micro_batches_per_step=4, ring_factor=False)
        for s in (1, 2, 3)
    ] == [2e9, 5e9, 12e9]


def test_tp_collective_counts():
    assert tp_collectives_per_layer() == {"all_reduce": 4, "all_gather": 0}
    assert tp_collectives_per_layer(recompute=True) == {"all_reduce": 6, "all_gather": 0}
    assert tp_collectives_per_layer(True, True) == {"all_reduce": 6, "all_gather": 1}


def test_tp_traffic_per_layer():
    assert tp_traffic_elements(1, 2048, 4096, 8) == 58_720_256
    assert tp_traffic_elements(1, 2048, 4096, 8) * 2 / 1e6 == pytest.approx(117.4, abs=0.1)
    assert tp_traffic_elements(1, 2048, 4096, 1) == 0


def test_pa_overhead_below_ten_percent():
    base = tp_traffic_elements(32, 1024, 8192, 16, recompute=True, ring_factor=False)
    with_pa = tp_traffic_elements(
        32, 1024, 8192, 16, recompute=True, partitioned_activations=True, ring_factor=False
    )
    assert base == 12 * 32 * 1024 * 8192
    assert with_pa / base - 1 == pytest.approx(1 / 12)


def test_vocab_parallel_cross_entropy_avoids_logit_gather():
    ce = vocab_parallel_cross_entropy_elements(8, 1024, 51200)
    assert ce["naive_all_gather"] == 419_430_400
    assert ce["fused_per_collective"] * ce["fused_collectives"] == 3 * 8 * 1024


# the planner ---------------------------------------------------------------------------------


def test_constant_buffers_do_not_grow_with_the_model():
    # what ZeroEngine allocates: 2 reduce-scatter pairs of (dp + 1) x bucket/dp gradient
    # elements and one bucket/dp all-gather staging (paper accounting: 2-byte gradients)
    big = [comm_buffer_bytes(p, 2, 50_000_000, 50_000_000, dp=50) for p in (10**9, 10**11)]
    assert big[0] == big[1] == 2 * 51 * 1_000_000 * 2 + 1_000_000 * 2
    small = comm_buffer_bytes(10_000_000, 1, 50_000_000, 50_000_000, dp=4)
    assert small == 2 * 5 * 2_500_000 * 2 + 2_500_000 * 2  # capped at the rank's partition
    assert comm_buffer_bytes(10**9, 0, 50_000_000, 50_000_000, dp=50) == 0  # in place
    assert (comm_buffer_bytes(10**9, 2, 50_000_000, 50_000_000, dp=50, overlap=False)
            == 51 * 1_000_000 * 2 + 2_000_000)
    # stage 3 also holds the root unit and two blocks (current + prefetch) gathered
    assert comm_buffer_bytes(10**9, 3, 50_000_000, 50_000_000, dp=50, largest_layer_params=7,
                             root_params=11) == big[0] + (11 + 2 * 7) * 2


def test_planner_picks_a_fitting_fast_layout():
    m = gpt(48, 1600, 16, v=50257, s=1024)
    cluster = plan.Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GB)
    cands, skipped = plan.plan(m, cluster, plan.Training(seq_length=1024, micro_batch_size=8))
    assert not skipped
    assert {c.tp for c in cands} == {1, 2, 4, 8} and {c.stage for c in cands} == {0, 1, 2, 3}
    chosen = plan.best(cands)
    assert chosen.fits and all(
        chosen.times["step_s"] <= c.times["step_s"] + 1e-9 for c in cands if c.fits
    )
    for c in cands:
        assert c.total_bytes == (
            c.model_states["total"] + c.activations["gpu"] + c.temporaries["total"] + c.buffers
            + 2**30  # the default reserve, 1 GiB (issue 28: memory in GiB)
        )
        assert c.tp * c.dp == 8
    tiny = plan.Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_bytes=1 * GB, reserved_bytes=0)
    on_gpu = plan.plan(m, tiny, plan.Training(seq_length=1024), offload_fractions=(0.0,))[0]
    assert plan.best(on_gpu) is None  # with the optimizer on the host it fits: test_plan_offload


def test_activation_options_order_memory_and_time():
    m = gpt(24, 2048, 16, s=2048)
    cluster = plan.Cluster(num_gpus=16, gpus_per_node=8)
    training = plan.Training(seq_length=2048, micro_batch_size=4)
    rows = {c.activation: c for c in plan.plan(m, cluster, training, tps=[4], stages=(1,))[0]}
    gpu = [rows[a].activations["gpu"] for a in ("none", "full", "full+pa", "full+pa+cpu")]
    assert gpu == sorted(gpu, reverse=True)
    step = [rows[a].times["step_s"] for a in ("none", "full", "full+pa", "full+pa+cpu")]
    assert step == sorted(step)
    assert rows["full+pa+cpu"].activations["cpu"] == checkpoint_bytes(24, 2048, 4, 2048, 4, True)


def test_zero_r_ablation_ordering():
    """ZeRO §10.5 Fig. 6 at MP = 16: max model C1 <= C2 <= C4 <= C5 (paper 40B < 60B < 140B <
    150B)."""
    m = gpt(1, 8192, 32, s=1024)
    cluster = plan.Cluster(
        num_gpus=400, gpus_per_node=16, gpu_memory_bytes=32 * GB, reserved_bytes=0
    )
    training = plan.Training(seq_length=1024, micro_batch_size=16)
    layers = [
        max_model.max_layers(m, cluster, training, 16, stage, act)
        for stage, act in ((1, "full"), (1, "full+pa"), (2, "full+pa"), (2, "full+pa+cpu"))
    ]
    assert layers == sorted(layers) and layers[0] < layers[1] < layers[2] < layers[3]


def test_bf16_gradients_halve_the_gradient_bytes_and_traffic_of_the_70b_pick():
    """Issue 33: --grad-reduce-in-bf16 on the planner's Llama-3-70B pick on 64 H100 (tp 8,
    ZeRO-1, s 4096): the engine-accounting gradient bytes per rank and the reduce-scatter
    bytes halve (2 instead of 4 per element); nothing else changes but the staging it holds."""
    from models.presets import get_preset

    model = get_preset("llama3-70b", hidden_dropout=0.0, attention_dropout=0.0)
    cluster = plan.Cluster(num_gpus=64, gpus_per_node=8)
    kw = dict(seq_length=4096, accounting="engine", dropout=False)
    fp32, bf16 = (plan.evaluate(model, cluster, plan.Training(**kw, zero=ZeroConfig(
        precision="bf16", param_persistence_threshold=0, grad_reduce_in_bf16=b)), 8, 1, "sp")
        for b in (False, True))
    assert 2 * bf16.model_states["grads"] == fp32.model_states["grads"]
    for k in ("params", "master", "optimizer"):
        assert bf16.model_states[k] == fp32.model_states[k]
    assert 2 * bf16.dp_bytes_by_kind["reduce_scatter"] == fp32.dp_bytes_by_kind["reduce_scatter"]
    assert bf16.dp_bytes_by_kind["all_gather"] == fp32.dp_bytes_by_kind["all_gather"]
    with pytest.raises(ValueError, match="bf16 gradients need bf16 training"):  # ZeroConfig's
        plan.Training(seq_length=8, zero=ZeroConfig(precision="fp32", grad_reduce_in_bf16=True))
