"""Megatron-LM's Llama-class model flags: parsing, Megatron's resolution of ambiguous
combinations, and each refusal (with the value and what would be valid) before any process
group starts."""

import re

import pytest
import torch.distributed as dist

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.pretrain import pretrain as main

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length",
        "32", "--mock-data", "--vocab-size", "500"]
# the Llama-3.2-style block, as Megatron-LM users pass it to pretrain_gpt.py
LLAMA = ["--num-layers", "28", "--hidden-size", "3072", "--ffn-hidden-size", "8192",
         "--num-attention-heads", "24", "--group-query-attention", "--num-query-groups", "8",
         "--kv-channels", "128", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--use-rope-scaling", "--rope-scaling-factor", "32", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-5", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--max-position-embeddings", "131072",
         "--seq-length", "8192", "--mock-data", "--vocab-size", "128256"]


def gpt(argv, world=1):
    return validate(parse_config(argv), world_size=world, local_world_size=world).gpt


def test_megatron_llama_block_parses():
    g = gpt(LLAMA, world=8)
    assert (g.num_layers, g.hidden_size, g.ffn_hidden_size, g.num_attention_heads) == (
        28, 3072, 8192, 24)
    assert (g.num_query_groups, g.kv_channels, g.head_dim) == (8, 128, 128)
    assert (g.position_embedding_type, g.rotary_base, g.use_rope_scaling) == ("rope", 500000, True)
    assert (g.rope_scaling_factor, g.normalization, g.swiglu) == (32.0, "RMSNorm", True)
    assert not g.add_bias_linear and not g.add_qkv_bias and not g.tied
    assert 3.2e9 < g.num_parameters() < 3.7e9  # Llama 3.2 3B


def test_defaults_are_the_gpt():
    g = gpt(BASE)
    assert (g.position_embedding_type, g.normalization, g.swiglu, g.num_query_groups) == (
        "learned_absolute", "LayerNorm", False, None)
    assert g.add_bias_linear and g.tied and g.ffn_hidden_size == 256


@pytest.mark.parametrize("extra,field,value", [
    (["--use-rotary-position-embeddings"], "position_embedding_type", "rope"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "rope"],
     "position_embedding_type", "rope"),
    (["--layernorm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),
    (["--group-query-attention"], "num_query_groups", 1),          # Megatron: default G = 1
    (["--num-query-groups", "2"], "num_query_groups", None),       # ignored without GQA
    (["--swiglu"], "ffn_hidden_size", 128),                        # int(4h * 2/3 / 64) * 64
    (["--disable-bias-linear", "--add-qkv-bias"], "add_qkv_bias", True),
    (["--position-embedding-type", "rope", "--rope-scaling-factor", "4"], "use_rope_scaling",
     False),                                                       # factor alone: no effect
])
def test_megatron_resolution(extra, field, value):
    assert getattr(gpt(BASE + extra), field) == value


def test_llama_preset_and_overrides():
    g = gpt(["--preset", "llama3-8b", "--num-layers", "2", "--mock-data", "--vocab-size", "1000",
             "--seq-length", "128"])
    assert (g.num_query_groups, g.position_embedding_type, g.swiglu, g.tied) == (
        8, "rope", True, False)
    g = gpt(["--preset", "llama3-8b", "--num-query-groups", "4", "--mock-data", "--vocab-size",
             "1000", "--seq-length", "128"])
    assert g.num_query_groups == 4
    assert gpt(["--preset", "llama3-8b", "--no-group-query-attention", "--mock-data",
                "--vocab-size", "1000"]).num_query_groups is None


def test_norm_epsilon_from_a_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("layernorm_epsilon: 1.0e-6\nnormalization: RMSNorm\n")
    assert gpt(BASE + ["--config", str(path)]).layernorm_epsilon == 1e-6


@pytest.mark.parametrize("extra,world,message", [
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     4, "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4: each TP rank "
        "holds whole K/V heads; valid tp values: 1, 2"),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-attention-heads 8 is not divisible by --num-query-groups 3: each K/V head serves a "
     "whole number of query heads; valid --num-query-groups: 1, 2, 4, 8"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], 1,
     "--rotary-percent 0.0 (ModelConfig.rotary_percent): must be in (0, 1]"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], 1,
     "--rotary-percent 1.5 (ModelConfig.rotary_percent): must be in (0, 1]"),
    (["--rotary-base", "500000", "--use-rope-scaling"], 1,
     "--rotary-base, --use-rope-scaling need(s) --position-embedding-type rope (or "
     "--use-rotary-position-embeddings); the model's is learned_absolute"),
    (["--position-embedding-type", "none", "--rotary-interleaved"], 1,
     "--rotary-interleaved need(s) --position-embedding-type rope"),
    (["--swiglu", "--ffn-hidden-size", "90", "--tensor-model-parallel-size", "4"], 4,
     "--ffn-hidden-size 90 is not divisible by --tensor-model-parallel-size 4"),
    (["--num-attention-heads", "6", "--kv-channels", "16", "--tensor-model-parallel-size", "4"],
     4, "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--max-position-embeddings", "16"], 1,
     "--seq-length 32 must be in [1, --max-position-embeddings 16]"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "none"], 1,
     "--use-rotary-position-embeddings and --position-embedding-type none are mutually exclusive"),
    (["--normalization", "rmsnorm"], 1, "invalid choice: 'rmsnorm'"),
    (["--position-embedding-type", "rope", "--kv-channels", "10", "--rotary-percent", "0.5"], 1,
     "rotary width int(kv_channels 10 * rotary_percent 0.5) = 5 must be a positive even number"),
])
def test_each_llama_refusal_names_the_values(extra, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        gpt(BASE + extra, world=world)


def test_refused_before_any_process_group(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(BASE + ["--group-query-attention", "--num-query-groups", "2",
                        "--tensor-model-parallel-size", "4"]) == 2
    assert "valid tp values: 1, 2" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_resume_refuses_another_architecture_and_reads_old_checkpoints():
    import dataclasses

    from hybrid.job.resume_checks import ResumeMismatch, check_model

    gpt_model = gpt(BASE)
    old = {k: v for k, v in dataclasses.asdict(gpt_model).items()
           if k not in ("swiglu", "normalization", "num_query_groups", "position_embedding_type")}
    check_model({"model": old, "iteration": 4}, gpt_model, "ck")  # predates the fields: defaults
    llama = gpt(BASE + ["--swiglu", "--ffn-hidden-size", "256", "--group-query-attention",
                        "--num-query-groups", "2"])
    with pytest.raises(ResumeMismatch, match=r"--swiglu False in the checkpoint, True here; "
                       r"--num-query-groups None in the checkpoint, 2 here; first differing "
                       r"parameter layers.0.attn.qkv.weight: \(192, 64\) in the checkpoint, "
                       r"\(96, 64\) here"):
        check_model({"model": old, "iteration": 4}, llama, "ck")
    rope = gpt(BASE + ["--position-embedding-type", "rope"])
    longer = dataclasses.replace(rope, max_position_embeddings=64)
    check_model({"model": dataclasses.asdict(rope), "iteration": 4}, longer, "ck")  # no table


def test_gpt2_export_and_init_from_hf_refuse_a_llama_model():
    from hybrid.hf.convert import (
        UnsupportedModelError,
        check_gpt2_architecture,
        gpt_config_from_metadata,
    )

    check_gpt2_architecture(gpt(BASE + ["--kv-channels", "8"]))  # h / a spelled out: GPT-2
    llama = gpt(BASE + ["--position-embedding-type", "rope", "--swiglu"])
    with pytest.raises(UnsupportedModelError, match="position_embedding_type='rope' "
                       r"\(GPT-2: 'learned_absolute'\), swiglu=True \(GPT-2: False\)"):
        gpt_config_from_metadata(__import__("dataclasses").asdict(llama))
