"""The Llama-class model flags of the plain model, checked against independent implementations:
transformers' LlamaForCausalLM (RoPE with Llama 3.1 scaling, RMSNorm, SwiGLU, GQA, no biases),
Qwen2ForCausalLM (``add_qkv_bias``) and Qwen3ForCausalLM (``qk_layernorm``), built from random
tiny configs with weights copied across; logits agree to 1e-5 in fp32 (the same math in a
different op order: summation order differences are ~1e-7 at these sizes). RoPE's interleaved
and partial forms are checked against the complex-number rotation of the RoFormer paper."""

import math

import pytest
import torch

from models.gpt import GPT, GPTConfig
from models.rope import RotaryEmbedding, apply_rotary

transformers = pytest.importorskip("transformers")

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
            vocab_size=101, max_position_embeddings=32, hidden_dropout=0.0,
            attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
            swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _hf_config(cfg: GPTConfig, kind: str):
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_position_embeddings,
              rms_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=False,
              rope_theta=cfg.rotary_base, attention_dropout=0.0)
    if cfg.use_rope_scaling:
        kw["rope_scaling"] = dict(rope_type="llama3", factor=cfg.rope_scaling_factor,
                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
    if kind == "llama":
        return transformers.LlamaConfig(**kw, attention_bias=False, mlp_bias=False)
    return getattr(transformers, f"{kind.capitalize()}Config")(**kw)


def _copy_to_hf(model: GPT, hf) -> None:
    """Our weights into the HF model: ``qkv`` rows (group, [q_1..q_n, k, v], d) are split into
    q_proj / k_proj / v_proj; both use the half-split rotate_half layout, so no row permutation."""
    cfg = model.config
    d, g, n = cfg.head_dim, cfg.query_groups, cfg.num_attention_heads // cfg.query_groups
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if p + f"attn.qkv.{kind}" not in sd:
                continue
            t = sd[p + f"attn.qkv.{kind}"].reshape(g, n + 2, d, -1)
            out[q + f"self_attn.q_proj.{kind}"] = t[:, :n].reshape(g * n * d, -1).squeeze(-1)
            out[q + f"self_attn.k_proj.{kind}"] = t[:, n].reshape(g * d, -1).squeeze(-1)
            out[q + f"self_attn.v_proj.{kind}"] = t[:, n + 1].reshape(g * d, -1).squeeze(-1)
        names = {"attn.proj": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj",
                 "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj", "ln1": "input_layernorm",
                 "ln2": "post_attention_layernorm", "attn.q_norm": "self_attn.q_norm",
                 "attn.k_norm": "self_attn.k_norm"}
        for ours, theirs in names.items():
            if p + ours + ".weight" in sd:
                out[q + theirs + ".weight"] = sd[p + ours + ".weight"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)


def _randomise(model: GPT) -> None:
    # init_weights leaves norm weights at 1 and biases at 0; randomise them so they are tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.startswith("ln") or ".ln" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight")
                        else 0.1 * torch.randn_like(p))


@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(num_query_groups=2, rotary_base=500000, use_rope_scaling=True,
                   rope_scaling_factor=32.0)),
    ("llama", dict(num_query_groups=1)),
    ("llama", dict(num_query_groups=4, kv_channels=24)),
    ("qwen2", dict(num_query_groups=2, add_qkv_bias=True, rotary_base=1000000)),
    ("qwen3", dict(num_query_groups=2, qk_layernorm=True, kv_channels=32)),
])
def test_logits_match_transformers(kind, kw):
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY, **kw)
    model = GPT(cfg).eval()
    _randomise(model)
    hf = getattr(transformers, f"{kind.capitalize()}ForCausalLM")(_hf_config(cfg, kind)).eval()
    _copy_to_hf(model, hf)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_is_the_complex_rotation(interleaved, percent):
    """RoFormer (arXiv 2104.09864 §3.4.2): pair j of position m is multiplied by
    ``exp(i m base^(-2j/r))``; pairs are (2j, 2j+1) interleaved, (j, j + r/2) otherwise."""
    d, s, base = 16, 9, 100.0
    rope = RotaryEmbedding(d, percent, base, interleaved)
    r = int(d * percent)
    x = torch.randn(2, 3, s, d, dtype=torch.float64)
    cos, sin = rope.tables(s, torch.device("cpu"), torch.float64)
    got = apply_rotary(x, cos, sin, interleaved)
    rot = x[..., :r]
    pairs = (rot.unflatten(-1, (r // 2, 2)) if interleaved
             else torch.stack((rot[..., :r // 2], rot[..., r // 2:]), dim=-1))
    theta = torch.tensor([base ** (-2 * j / r) for j in range(r // 2)], dtype=torch.float64)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones_like(angle), angle))
    want = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
    torch.testing.assert_close(got[..., :r], want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[..., r:], x[..., r:])


def test_rope_tables_are_built_once_per_length():
    model = GPT(GPTConfig(**TINY))
    tokens = torch.randint(0, 101, (1, 8))
    model(tokens)
    model(tokens)
    model(tokens[:, :4])
    assert len(model.rotary._tables) == 2
    assert all(b.attn.rotary is model.rotary for b in model.layers)


def test_swiglu_default_width_is_megatrons():
    cfg = GPTConfig(num_layers=1, hidden_size=4096, num_attention_heads=32, swiglu=True)
    assert cfg.ffn_hidden_size == int(4 * 4096 * 2 / 3 / 64) * 64 == 10880


def test_gqa_dropout_path_equals_sdpa_without_dropout():
    """The explicit attention (CPU's path with attention dropout) groups heads like SDPA's
    enable_gqa: at p = 0 in training mode it must give the SDPA result."""
    torch.manual_seed(1)
    cfg = GPTConfig(**dict(TINY, attention_dropout=0.0), num_query_groups=2)
    model = GPT(cfg)
    attn = model.layers[0].attn
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)
    torch.testing.assert_close(attn._explicit(q, k, v), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(num_query_groups=3), "not divisible by num_query_groups=3; valid groups"),
    (dict(rotary_percent=0.0), r"rotary_percent=0.0 must be in \(0, 1\]"),
    (dict(rotary_percent=1.5), r"rotary_percent=1.5 must be in \(0, 1\]"),
    (dict(kv_channels=16, rotary_percent=0.2), "must be a positive even number"),
    (dict(normalization="rmsnorm"), "valid: .'LayerNorm', 'RMSNorm'"),
    (dict(position_embedding_type="alibi"), "valid: .'learned_absolute', 'rope', 'none'"),
])
def test_bad_llama_config_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**dict(TINY, **kw))


def test_parameter_names_and_init():
    cfg = GPTConfig(**TINY, num_query_groups=2, qk_layernorm=True, add_qkv_bias=True)
    model = GPT(cfg)
    model.init_weights(seed=3)
    names = dict(model.named_parameters())
    assert "wpe.weight" not in names and "layers.0.ln1.bias" not in names
    assert names["layers.0.attn.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert names["layers.0.attn.qkv.bias"].abs().sum() == 0
    assert "layers.0.attn.proj.bias" not in names and "layers.0.mlp.gate.bias" not in names
    assert torch.all(names["layers.1.attn.q_norm.weight"] == 1)
    std = names["layers.0.mlp.fc2.weight"].std().item()
    assert std == pytest.approx(0.02 / math.sqrt(4), rel=0.1)


@pytest.mark.parametrize("name,count", [
    ("llama2-7b", 6_738_415_616),       # Meta's released Llama-2-7b-hf
    ("llama3-8b", 8_030_261_248),       # Meta-Llama-3-8B
    ("llama3-70b", 70_553_706_496),     # Meta-Llama-3-70B
    ("llama3.1-405b", 405_853_388_800),  # Llama-3.1-405B
])
def test_llama_presets_count_the_published_parameters(name, count):
    from models.presets import get_preset

    cfg = get_preset(name)
    assert cfg.num_parameters() == count
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == count


def test_fused_rms_norm_and_swiglu_match_the_composite_forms():
    """Same values and gradients as torch's composite forms (float64 gradcheck, fp32 1e-6)."""
    from models.norms import rms_norm
    from models.swiglu import swiglu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))
    assert torch.autograd.gradcheck(swiglu, (x, a))
    xf, wf, af = (t.detach().float().requires_grad_(True) for t in (x, w, a))
    for ours, theirs in ((lambda: rms_norm(xf, wf, 1e-5),
                          lambda: torch.nn.functional.rms_norm(xf, (8,), wf, 1e-5)),
                         (lambda: swiglu(xf, af),
                          lambda: torch.nn.functional.silu(xf) * af)):
        got = torch.autograd.grad(ours().square().sum(), (xf, wf, af), allow_unused=True)
        want = torch.autograd.grad(theirs().square().sum(), (xf, wf, af), allow_unused=True)
        torch.testing.assert_close(ours(), theirs(), atol=1e-6, rtol=1e-6)
        for gg, ww in zip(got, want, strict=True):
            assert (gg is None) == (ww is None)
            if gg is not None:
                torch.testing.assert_close(gg, ww, atol=1e-5, rtol=1e-5)
