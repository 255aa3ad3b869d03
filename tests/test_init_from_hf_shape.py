"""``--init-from-hf DIR`` alone takes the model's shape from ``DIR/config.json`` (issue 36) and
the job prints the flag line it used; explicit flags that disagree are still refused."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, validate  # noqa: E402
from hybrid.job.pretrain import _checked_job  # noqa: E402

REST = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
        "--eval-iters", "0"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
        tie_word_embeddings=False)).save_pretrained(str(d / "llama"))
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=120, n_positions=64,
                               activation_function="gelu")).save_pretrained(str(d / "gpt2"))
    return d


def test_the_shape_comes_from_config_json_and_the_line_is_printed(hf_dirs, capsys):
    argv = ["--init-from-hf", str(hf_dirs / "llama"), *REST]
    used: list[str] = []
    job = validate(parse_config(argv, None, used), world_size=1)
    g = job.gpt
    assert (g.num_layers, g.hidden_size, g.num_attention_heads, g.query_groups,
            g.ffn_hidden_size, g.vocab_size, g.swiglu, g.normalization, g.tied) == (
        3, 64, 4, 2, 96, 300, True, "RMSNorm", False)
    _checked_job(argv)
    out = capsys.readouterr().out
    assert f"--init-from-hf {hf_dirs / 'llama'}: the model flags of its config.json: " \
           + " ".join(used) in out
    again = validate(parse_config(used + REST), world_size=1)  # reproducible without the dir
    assert again.gpt == g
    gpt2 = validate(parse_config(["--init-from-hf", str(hf_dirs / "gpt2"), *REST]), world_size=1)
    assert (gpt2.gpt.num_layers, gpt2.gpt.hidden_size, gpt2.gpt.vocab_size) == (2, 32, 120)


def test_explicit_flags_that_disagree_are_refused_as_before(hf_dirs):
    llama = str(hf_dirs / "llama")
    with pytest.raises(ConfigError, match="ffn-hidden-size 96"):
        validate(parse_config(["--init-from-hf", llama, "--ffn-hidden-size", "128", *REST]),
                 world_size=1)
    with pytest.raises(ConfigError, match="give --preset or all of --hidden-size"):
        validate(parse_config(["--init-from-hf", llama, "--num-layers", "3", "--vocab-size", "300",
                               *REST]),
                 world_size=1)
