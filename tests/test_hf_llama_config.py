"""Llama / Qwen2 / Qwen3 settings and names, one process: the config mapping with its named
mismatches and refusals, nothing dropped on import, the class export picks, and the tokenizer
an export accepts. Logits: exact layout moves give bitwise-equal logits (rtol 0); the
``--rotary-interleaved`` permutation changes the summation order only (1e-6)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_hf_llama import FAMILIES, random_hf  # noqa: E402

from hybrid.hf import llama_weights  # noqa: E402
from hybrid.hf.convert import UnsupportedModelError  # noqa: E402
from hybrid.hf.export import model_family  # noqa: E402
from hybrid.hf.export_tokenizer import tokenizer_source  # noqa: E402
from hybrid.hf.llama_config import UnsupportedHFSetting, hf_settings  # noqa: E402
from hybrid.hf.sharded import parse_size, plan_shards  # noqa: E402
from hybrid.hf.weights import HFWeights, check_config  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def ours(family: str, **overrides) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, max_position_embeddings=16384, hidden_dropout=0.0,
                attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                swiglu=True, layernorm_epsilon=1e-5, add_bias_linear=False)
    base.update({"llama": dict(vocab_size=400, rotary_base=500000.0, use_rope_scaling=True,
                               untie_embeddings_and_output_weights=True),
                 "qwen2": dict(vocab_size=512, add_qkv_bias=True,
                               untie_embeddings_and_output_weights=True),
                 "qwen3": dict(vocab_size=400, qk_layernorm=True, kv_channels=32)}[family])
    return GPTConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_cfg")
    return d, {f: random_hf(f, d / f, seed=i) for i, f in enumerate(FAMILIES)}


def _edit(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_gives_transformers_logits(dirs, family, interleaved):
    d, models = dirs
    config = ours(family, rotary_interleaved=interleaved)
    src, model = HFWeights(d / family, config), GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src(name))
            back = llama_weights.to_hf(name, src(name), config)
            for key, t in zip(llama_weights.hf_keys(name), back, strict=True):
                assert torch.equal(t, models[family].state_dict()[key]), key
        x = torch.randint(0, 400, (2, 20), generator=torch.Generator().manual_seed(1))
        got, want = model(x), models[family](x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if interleaved else 0)


def test_both_rope_spellings_and_the_refusals(dirs):
    hf = json.loads((dirs[0] / "llama" / "config.json").read_text())
    new = hf_settings(hf)
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192})
    assert hf_settings(old) == new and new["rotary_base"] == 500000.0
    assert new["use_rope_scaling"] and new["rope_scaling_factor"] == 8.0
    refused = {"rope type 'yarn'": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
               "high_freq_factor=2.0": dict(rope_parameters={**hf["rope_parameters"],
                                                             "high_freq_factor": 2.0}),
               "use_sliding_window=True": dict(use_sliding_window=True),
               "layer_types \\['sliding_attention'\\]": dict(layer_types=["sliding_attention"]),
               "hidden_act='gelu'": dict(hidden_act="gelu"),
               "attention_bias=True with mlp_bias=False": dict(attention_bias=True),
               "model_type='mistral'": dict(model_type="mistral")}
    for match, change in refused.items():
        with pytest.raises(UnsupportedHFSetting, match=match):
            hf_settings({**hf, **change})
    qwen2 = json.loads((dirs[0] / "qwen2" / "config.json").read_text())
    assert hf_settings({**qwen2, "use_sliding_window": False, "sliding_window": 4096})
    # several at once are named at once (they were refused one per attempt)
    with pytest.raises(UnsupportedHFSetting) as e:
        hf_settings({**hf, **refused["hidden_act='gelu'"], **refused["use_sliding_window=True"],
                     "rope_parameters": {"rope_type": "yarn"}, "attention_bias": True})
    assert str(e.value) == (
        "config.json: 4 settings are not held here: use_sliding_window=True (sliding-window "
        "attention is not held here); hidden_act='gelu' (SwiGLU needs 'silu'); rope type 'yarn' "
        "is not held here (only 'default' and 'llama3'); attention_bias=True with "
        "mlp_bias=False: biases are on every linear layer or none here")


def test_a_mismatch_is_named_with_our_flag(dirs):
    hf = json.loads((dirs[0] / "llama" / "config.json").read_text())
    cases = {"num_key_value_heads 2, this run 4: give --group-query-attention --num-query-groups 2":
                 dict(num_query_groups=4),
             "rope_theta 500000, this run 10000: give --rotary-base 500000":
                 dict(rotary_base=10000.0),
             "tie_word_embeddings false \\(untied\\): add --untie-embeddings-and-output-weights":
                 dict(untie_embeddings_and_output_weights=False),
             "attention_bias and mlp_bias false: add --disable-bias-linear":
                 dict(add_bias_linear=True)}
    for match, change in cases.items():
        with pytest.raises(ValueError, match="in 1 setting:\n  config.json has " + match):
            check_config(hf, ours("llama", **change))


def test_nothing_is_dropped_silently(tmp_path, dirs):  # issue 27 kind 11
    d, models = dirs
    tied = tmp_path / "tied"
    models["qwen3"].save_pretrained(str(tied))
    weights = load_file(str(tied / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tied / "model.safetensors"))
    HFWeights(tied, ours("qwen3"))  # a tied head saved anyway, equal: accepted
    weights["lm_head.weight"][3, 5] += 1.0
    save_file(weights, str(tied / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight differs .* --untie-embeddings"):
        HFWeights(tied, ours("qwen3"))
    untied = tmp_path / "untied"  # an untied model whose config says tied
    models["llama"].save_pretrained(str(untied))
    _edit(untied, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        HFWeights(untied, ours("llama", untie_embeddings_and_output_weights=False))
    weights = load_file(str(untied / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = ours("llama").rotary().inv_freq()
    weights["model.layers.0.mlp.extra.weight"] = torch.ones(2)
    _edit(untied, tie_word_embeddings=False)
    save_file(weights, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra.weight' has no place .* "
                                         "would be dropped"):
        HFWeights(untied, ours("llama"))
    del weights["model.layers.0.mlp.extra.weight"]
    save_file(weights, str(untied / "model.safetensors"))
    HFWeights(untied, ours("llama"))  # the frequencies our RoPE computes: accepted
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] *= 2
    save_file(weights, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="inv_freq differs from the RoPE frequencies"):
        HFWeights(untied, ours("llama"))


def test_export_picks_the_class_or_names_the_setting():
    def family(**kw):
        return model_family(vars(ours("llama", **kw)))[1]

    assert family() == "llama" and family(add_bias_linear=True) == "llama"
    assert family(add_qkv_bias=True) == "qwen2"
    assert family(qk_layernorm=True, kv_channels=32) == "qwen3"
    assert model_family(vars(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                       vocab_size=50)))[1] == "gpt2"
    for match, kw in {"normalization='LayerNorm'": dict(normalization="LayerNorm"),
                      "swiglu=False": dict(swiglu=False),
                      "rotary_percent=0.5": dict(rotary_percent=0.5),
                      "qk_layernorm with add_qkv_bias": dict(qk_layernorm=True,
                                                             add_qkv_bias=True)}.items():
        with pytest.raises(UnsupportedModelError, match=match):
            family(**kw)


def test_export_refuses_a_tokenizer_of_another_vocabulary(tmp_path):  # issue 27 kind 12
    from hf_helpers import byte_bpe_tokenizer

    from tests.data_helpers import tiny_tokenizer

    sp = tiny_tokenizer(tmp_path)  # 600 pieces
    assert tokenizer_source(sp, None, {}, 600).vocab_size == 600
    with pytest.raises(ValueError, match="has 600 tokens but the model's vocabulary is 512"):
        tokenizer_source(sp, None, {}, 512)
    a = byte_bpe_tokenizer(tmp_path / "a", ["hello world"] * 3, vocab_size=300)
    b = byte_bpe_tokenizer(tmp_path / "b", ["other text!"] * 3, vocab_size=300)
    trained = {"tokenizer": str(a), "config": {"data": {"tokenizer_type": None}}}
    assert tokenizer_source(None, None, trained, 320).model_path == str(a)
    with pytest.raises(ValueError, match="differs from the tokenizer the checkpoint was trained"):
        tokenizer_source(b, None, trained, 320)


def test_shard_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(1000) == 1000
    with pytest.raises(ValueError, match="--max-shard-size '5 parsecs'"):
        parse_size("5 parsecs")
    from hybrid.checkpoint.stream import Entry

    es = [Entry(str(i), torch.float32, (n,), None) for i, n in enumerate([10, 10, 30, 5])]
    assert [[e.key for e in s] for s in plan_shards(es, 80)] == [["0", "1"], ["2"], ["3"]]
