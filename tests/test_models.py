"""The plain GPT and its presets."""

import pytest
import torch

from models.gpt import GPT, GPTConfig
from models.presets import get_preset, list_presets


def test_gpt2_124m_counts_124439808_and_matches_ptdp_formula():
    cfg = get_preset("gpt2-124m")
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    n_l, h, v, s = 12, 768, 50257, 1024
    assert n == cfg.num_parameters() == 124_439_808
    assert n == 12 * n_l * h * h + 13 * n_l * h + (v + s) * h + 2 * h  # PTD-P Eq. 2 + final LN


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_builds_on_meta_and_counts_match(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("name,billions", [("megatron-8.3b", 8.3), ("gpt3-175b", 175),
                                           ("zero-100b", 100), ("gpt2-1.5b", 1.5),
                                           ("zero-170b", 170)])
def test_preset_sizes_match_their_names(name, billions):
    assert get_preset(name).num_parameters() / 1e9 == pytest.approx(billions, rel=0.05)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(KeyError, match="gpt2-124m"):
        get_preset("gpt-5")


def test_untied_adds_output_weight():
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=100,
                    untie_embeddings_and_output_weights=True)
    model = GPT(cfg)
    assert "lm_head.weight" in dict(model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("kw,match", [
    (dict(hidden_size=30, num_attention_heads=4), "not divisible"),
    (dict(num_layers=0), "num_layers"),
    (dict(hidden_dropout=1.0), "hidden_dropout"),
])
def test_bad_config_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kw)


def test_seeded_init_is_reproducible_and_forward_runs():
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97,
                    max_position_embeddings=16)
    a, b = GPT(cfg), GPT(cfg)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    tokens = torch.randint(0, 97, (2, 16))
    assert a(tokens).shape == (2, 16, 97)
    assert a(tokens, tokens).shape == (2, 16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        a(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("name", list_presets())
def test_planner_counts_every_preset_like_the_model(name):
    from hybrid.flops import num_parameters

    cfg = get_preset(name)
    assert num_parameters(cfg) == cfg.num_parameters()
