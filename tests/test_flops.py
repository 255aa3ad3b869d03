"""Parameter, FLOP, MFU and training-time arithmetic against the papers (arXiv 2104.04473 Eqs. 2-4,
2205.05198 Eqs. 7-8)."""

import dataclasses

import pytest

from hybrid import flops
from hybrid.parallel.vocab import pad_vocab_size
from models.config import GPTConfig


def gpt(layers, h, a, v=51200, s=2048, **kw):
    return GPTConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=a,
        vocab_size=v,
        max_position_embeddings=s,
        **kw,
    )


GPT2_SMALL = gpt(12, 768, 12, v=50257, s=1024)
GPT3 = gpt(96, 12288, 96)
ONE_T = gpt(128, 25600, 160)


# item 13 -------------------------------------------------------------------------------------


def test_gpt2_small_parameter_count_matches_hf():
    assert flops.num_parameters(GPT2_SMALL) == 124_439_808
    no_final_ln = flops.num_parameters(GPT2_SMALL, final_layernorm=False)
    assert no_final_ln == 124_438_272  # 2104.04473 Eq. 2 exactly


@pytest.mark.parametrize(
    ("layers", "h", "s", "billions", "rel"),
    [
        (48, 8192, 2048, 39.10, 1e-3),  # 2104.04473 Table 1
        (72, 3072, 1024, 8.317, 1e-3),  # Megatron 8.3B
        (40, 1536, 1024, 1.213, 1e-3),
        (128, 25600, 2048, 1008.04, 1e-4),
    ],
)
def test_parameter_formula_reproduces_papers(layers, h, s, billions, rel):
    assert flops.num_parameters(gpt(layers, h, 32, s=s)) / 1e9 == pytest.approx(billions, rel=rel)


def test_generalised_parameter_count():
    h, f, v, s, n = 64, 96, 1000, 32, 3
    m = gpt(n, h, 4, v=v, s=s, ffn_hidden_size=f, untie_embeddings_and_output_weights=True)
    per_layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h
    assert flops.num_parameters(m) == n * per_layer + (v + s) * h + v * h + 2 * h


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_sum_back_to_the_total(tp):
    m = gpt(4, 256, 8, v=pad_vocab_size(50257, tp))
    sharded, replicated = flops.parameter_split(m)
    assert sharded % tp == 0
    assert tp * (
        flops.parameters_per_tp_rank(m, tp) - replicated
    ) + replicated == flops.num_parameters(m)


def test_gpt_config_and_bad_tp():
    cfg = GPTConfig(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        ffn_hidden_size=None,
        vocab_size=50257,
        max_position_embeddings=1024,
        untie_embeddings_and_output_weights=False,
    )
    assert flops.num_parameters(cfg) == 124_439_808
    with pytest.raises(ValueError, match="tp=5 does not divide num_attention_heads=12"):
        flops.parameters_per_tp_rank(cfg, 5)
    with pytest.raises(ValueError, match="vocab_size=50257 \\(pad it"):
        flops.parameters_per_tp_rank(cfg, 2)
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got -1"):
        dataclasses.replace(cfg, hidden_size=-1)


# item 14 -------------------------------------------------------------------------------------


def test_eq3_full_recompute_flops_for_1t():
    f96 = flops.flops_per_iteration(ONE_T, 3072, 2048, "full")
    assert f96 == pytest.approx(5.139e19, rel=1e-3)
    b, s, n, h, v = 3072, 2048, 128, 25600, 51200
    assert f96 == pytest.approx(
        96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)), rel=1e-12
    )
    model = flops.flops_per_iteration(ONE_T, 3072, 2048, "none")
    assert model == pytest.approx(
        72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)), rel=1e-12
    )
    sel = flops.flops_per_iteration(ONE_T, 3072, 2048, "selective")
    assert sel == pytest.approx(
        72 * b * s * n * h * h * (1 + s / (3 * h) + v / (12 * n * h)), rel=1e-12
    )


@pytest.mark.parametrize(
    ("model", "batch", "gpus", "time_s", "mfu", "hfu", "tol"),
    [
        (GPT3, 64, 64, 13.75, 0.514, 0.528, 0.001),
        (ONE_T, 512, 512, 71.49, 0.563, 0.570, 0.001),
        (gpt(48, 6144, 64), 4, 8, 1.10, 0.415, 0.437, 0.003),  # paper rounds differently, 0.3 pp
    ],
)
def test_mfu_hfu_table5(model, batch, gpus, time_s, mfu, hfu, tol):
    assert flops.mfu(model, batch, 2048, time_s, gpus, 312) == pytest.approx(mfu, abs=tol)
    assert flops.hfu(model, batch, 2048, time_s, gpus, 312, "selective") == pytest.approx(
        hfu, abs=tol
    )


def test_gpt3_model_flops_value():
    assert flops.flops_per_iteration(GPT3, 64, 2048) == pytest.approx(1.4109e17, rel=1e-4)


def test_tokens_per_second_to_tflops():
    # 175B: 64 * 2048 tokens in 13.75 s on 64 GPUs is 51.4% of 312 TF.
    tps = 64 * 2048 / 13.75
    tf = flops.tflops_per_device_from_tokens(GPT3, tps, 2048, 64)
    assert tf / 312 == pytest.approx(0.514, abs=0.001)


def test_megatron_weak_scaling_arithmetic():
    # item 19: 15.1 PF over 512 GPUs against the 39 TF single-GPU baseline = 76%.
    assert flops.utilization(15.1e15, 1.0, 512, 39) == pytest.approx(0.756, abs=0.001)


# item 15 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "params", "n", "x", "days"),
    [(300e9, 175e9, 1024, 140, 33.9), (450e9, 1e12, 3072, 163, 83.2)],
)
def test_training_time_eq4(tokens, params, n, x, days):
    assert flops.training_time_s(tokens, params, n, x) / 86400 == pytest.approx(days, abs=0.05)


# item 16 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "padded"), [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_vocab_padding(tp, padded):
    assert pad_vocab_size(50257, tp, 128) == padded
    assert pad_vocab_size(padded, tp, 128) == padded


def test_device_peaks():
    assert flops.device_peak_tflops("Tesla V100-SXM2-32GB") == 125
    assert flops.device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert flops.device_peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert flops.device_peak_tflops("NVIDIA H100 PCIe") == 756
    assert flops.device_peak_tflops("NVIDIA H200") == 989
    assert flops.device_peak_tflops("Some CPU") is None


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="recompute"):
        flops.flops_per_iteration(GPT2_SMALL, 1, 1024, "sometimes")
    with pytest.raises(ValueError, match="vocab_size must be positive, got -3"):
        pad_vocab_size(-3)
