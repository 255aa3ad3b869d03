"""Hugging Face interop: export to / import from ``GPT2LMHeadModel``, the tokenizer, sampling.

Tolerances: logits and losses of transformers' GPT-2 against our model (one process or
tp2 x dp2) agree to 1e-5 in fp32 (the same arithmetic, summed in another order across TP
ranks). Weights that only move between layouts (export, import, export again) are compared
bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from data.tokenizer import Tokenizer  # noqa: E402
from data.train_tokenizer import train_tokenizer  # noqa: E402
from hybrid.checkpoint.directory import latest_iteration  # noqa: E402
from hybrid.hf.convert import (  # noqa: E402
    UnsupportedModelError,
    check_hf_config,
    from_hf,
    gpt_config_from_metadata,
    hf_name,
    parameter_names,
    to_hf,
)
from hybrid.hf.export import export_hf  # noqa: E402
from hybrid.hf.export import main as export_main  # noqa: E402
from hybrid.hf.generate import main as generate_main  # noqa: E402
from hybrid.hf.tokenizer import build_tokenizer, save_tokenizer  # noqa: E402
from hybrid.hf.weights import HFWeights  # noqa: E402
from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, validate  # noqa: E402
from hybrid.parallel.spawn import spawn_world  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from tests.data_helpers import tiny_corpus  # noqa: E402
from tests.hf_worlds import run_and_evaluate  # noqa: E402
from tests.pretrain_worlds import prepare_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=600)
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "64"]
EXTRA_TEXTS = ["é😀 ok", "汉字と仮名、한국어", "e\u0301 a\u0308\u0323 n\u0303",
               "🧑\u200d🤝\u200d🧑 family", "  two  spaces\n\nand\ttabs ", "", "\x00\x7f control",
               "<|sep|> user symbol", "</s> <s> <pad> <unk> <0x41> spelled-out specials stay text",
               "\u2581 a literal whitespace symbol\u2581\u2581, sparks \u2581\u2582\u2583"]


def random_gpt2(directory: Path, tied: bool = True, seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with every tensor random (LayerNorms and biases too), saved locally."""
    torch.manual_seed(seed)
    cfg = GPT2Config(**{**SHAPE, **overrides}, activation_function="gelu", resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, eos_token_id=2,
                     bos_token_id=1)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return model


def our_config(**overrides) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=600,
                     max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                     **overrides)


# ---- tokenizer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus_lines(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_corpus")
    texts = [json.loads(line)["text"]
             for line in tiny_corpus(d, 400_000).read_text(encoding="utf-8").splitlines()]
    return d, texts, [line for t in texts for line in t.split("\n") if line.strip()]


@pytest.mark.parametrize("model_type, vocab", [("bpe", 2000), ("unigram", 1000)])
def test_exported_tokenizer_matches_sentencepiece(corpus_lines, model_type, vocab):
    d, texts, lines = corpus_lines
    train_tokenizer(texts, d / model_type, vocab, model_type=model_type,
                    user_defined_symbols=["<|sep|>"])
    ours = Tokenizer(d / f"{model_type}.model")
    ids = save_tokenizer(ours.model_path, d / f"hf_{model_type}")
    hf = AutoTokenizer.from_pretrained(str(d / f"hf_{model_type}"))
    assert ids["eos_token_id"] == hf.eos_token_id == ours.eod
    assert len(hf) == ours.vocab_size
    sample = lines[:1000] + EXTRA_TEXTS
    assert len(sample) == 1010
    expected = ours.encode(sample)
    id_mismatch = [t for t, e in zip(sample, expected, strict=True)
                   if hf.encode(t, add_special_tokens=False) != e]
    text_mismatch = [t for t, e in zip(sample, expected, strict=True)
                     if hf.decode(e) != t or ours.decode(e) != t]
    assert id_mismatch == [] and text_mismatch == []
    # a whole document with its newlines, and a batch through the tokenizer's __call__
    assert hf(texts[:3], add_special_tokens=False)["input_ids"] == ours.encode(texts[:3])


def test_tokenizer_export_refuses_a_normalising_model(corpus_lines, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    d, texts, _ = corpus_lines
    train_tokenizer(texts[:20], tmp_path / "t", 400)
    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString((tmp_path / "t.model").read_bytes())
    m.normalizer_spec.add_dummy_prefix = True
    (tmp_path / "dummy.model").write_bytes(m.SerializeToString())
    with pytest.raises(ValueError, match="add_dummy_prefix=True"):
        build_tokenizer(tmp_path / "dummy.model")


# ---- conversion, one process -------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_weights_give_our_logits_and_convert_back_bitwise(tmp_path, tied):
    hf = random_gpt2(tmp_path, tied=tied)
    config = our_config(untie_embeddings_and_output_weights=not tied)
    source = HFWeights(tmp_path, config)
    ours = GPT(config).eval()
    ours.load_state_dict({n: source(n) for n in source.names()}, strict=True)
    tokens = torch.randint(0, 600, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
        loss = ours(tokens[:, :-1], tokens[:, 1:]).mean()
        torch.testing.assert_close(loss, hf(tokens, labels=tokens).loss, rtol=0, atol=1e-5)
    saved = load_file(str(tmp_path / "model.safetensors"))
    for name in parameter_names(config):
        assert torch.equal(to_hf(name, source(name), config), saved[hf_name(name)]), name
    assert set(map(hf_name, parameter_names(config))) == set(saved)


def test_qkv_layout_is_heads_outermost():
    """Row r of our qkv weight is (head, q|k|v, d); GPT-2's column is (q|k|v, head, d)."""
    config = GPTConfig(num_layers=1, hidden_size=6, num_attention_heads=2, vocab_size=10)
    rows = torch.arange(18.0)[:, None].expand(18, 6)  # row index as value
    cols = to_hf("layers.0.attn.qkv.weight", rows, config)[0]  # [18]: which row went to each column
    # column (which=1 [k], head=0, d=2) -> row (head=0, which=1, d=2) = 0*9 + 1*3 + 2 = 5
    # q of head 1 starts at row 9
    assert cols[1 * 6 + 0 * 3 + 2] == 5 and cols[0 * 6 + 1 * 3 + 0] == 9
    assert torch.equal(from_hf("layers.0.attn.qkv.weight",
                               to_hf("layers.0.attn.qkv.weight", rows, config), config), rows)


def test_import_names_every_mismatch(tmp_path):
    random_gpt2(tmp_path)
    config = our_config()
    with pytest.raises(ValueError, match="in 2 settings:\n  config.json has n_embd 64, this run "
                       "128: give --hidden-size 64\n  config.json has n_inner 256, this run 512: "
                       "give --ffn-hidden-size 256\n"):
        HFWeights(tmp_path, GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4,
                                      vocab_size=600, max_position_embeddings=64))
    hf = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="activation_function='gelu_new'"):
        check_hf_config(dict(hf, activation_function="gelu_new"), config)
    with pytest.raises(UnsupportedModelError) as e:  # several: all at once, not one per attempt
        check_hf_config(dict(hf, activation_function="gelu_new", add_cross_attention=True),
                        config)
    assert "activation_function='gelu_new'" in str(e.value)
    assert "; add_cross_attention=True, but our GPT needs False" in str(e.value)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["transformer.h.1.mlp.c_fc.weight"] = (
        state["transformer.h.1.mlp.c_fc.weight"][:, :200].contiguous())
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError,
                       match=r"transformer.h.1.mlp.c_fc.weight has shape \[64, 200\].*\[256, 64\]"):
        HFWeights(tmp_path, config)
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor 'transformer.h.1.mlp.c_fc.weight' for our "
                       "parameter 'layers.1.mlp.fc1.weight'"):
        HFWeights(tmp_path, config)


def test_init_from_hf_is_checked_before_any_process_group(tmp_path):
    random_gpt2(tmp_path)
    base = MODEL_FLAGS + ["--mock-data", "--vocab-size", "600", "--init-from-hf", str(tmp_path)]
    validate(parse_config(base), world_size=4)  # matching shapes pass
    with pytest.raises(ConfigError, match="n_layer 2, this run 3: give --num-layers 2") as e:
        validate(parse_config(base + ["--num-layers", "3"]), world_size=4)
    pasted = str(e.value).splitlines()[-1].split()  # the flag line that reproduces config.json
    rest = base[len(MODEL_FLAGS):] + ["--seq-length", "32"]
    validate(parse_config(pasted + rest), world_size=4)
    with pytest.raises(ConfigError, match="--init-from-hf and --finetune"):
        validate(parse_config(base + ["--finetune", "--load", str(tmp_path)]), world_size=4)
    with pytest.raises(ConfigError, match="no config.json"):
        validate(parse_config(base[:-1] + [str(tmp_path / "nowhere")]), world_size=4)


def test_export_refuses_what_gpt2_cannot_express():
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        gpt_config_from_metadata(dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_experts=8))
    with pytest.raises(UnsupportedModelError, match="normalization='RMSNorm'"):
        gpt_config_from_metadata(dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                      normalization="RMSNorm"))


def test_nothing_outside_hybrid_hf_imports_transformers():
    users = [p.relative_to(ROOT).as_posix() for d in ("hybrid", "models", "data")
             for p in (ROOT / d).rglob("*.py")
             if "transformers" in p.read_text() and "import" in p.read_text()
             and any(line.lstrip().startswith(("import transformers", "from transformers"))
                     for line in p.read_text().splitlines())]
    # and data.preprocess's GPT2BPETokenizer (Megatron-LM's --vocab-file/--merge-file), which
    # imports it inside its constructor: preprocessing only, never training
    assert sorted(users) == ["data/gpt2_bpe.py", "hybrid/hf/export.py", "hybrid/hf/generate.py",
                             "hybrid/hf/tokenizer.py"]
    code = ("import sys, hybrid.pretrain, hybrid.hf.weights, hybrid.job.checkpointing, "
            "hybrid.job.config_checks; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT)})


# ---- the distributed acceptance runs (one 4-rank spawn) ----------------------------------------

@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """tp2 x dp2 ZeRO-3 trains 3 steps with dropout and saves; tp2 x dp2 ZeRO-2 imports a random
    GPT-2 with --init-from-hf, takes one step at lr 0 (weights unchanged) and saves."""
    d = tmp_path_factory.mktemp("hf_worlds")
    prefix, tok = prepare_data(d / "data")
    imported = random_gpt2(d / "gpt2", seed=3)
    common = MODEL_FLAGS + ["--data-path", prefix, "--tokenizer-model", tok, "--split", "1",
                            "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size",
                            "8", "--log-interval", "1", "--seed", "5",
                            "--tensor-model-parallel-size", "2"]
    trained = common + ["--zero-stage", "3", "--train-iters", "3", "--lr", "3e-3",
                        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save",
                        str(d / "trained")]
    loaded = common + ["--zero-stage", "2", "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                       "--hidden-dropout", "0", "--attention-dropout", "0",
                       "--init-from-hf", str(d / "gpt2"), "--save", str(d / "imported")]
    tokens = torch.randint(0, 600, (4, 33), generator=torch.Generator().manual_seed(7))
    runs = spawn_world(4, run_and_evaluate, [trained, loaded], tokens, timeout_s=120)[0]
    return dict(d=d, tok=tok, tokens=tokens, trained=runs[0], imported=runs[1], hf_model=imported)


@pytest.mark.timeout(600)
def test_export_of_tp2_dp2_zero3_gives_distributed_logits_and_loss(worlds, capsys):
    d, tokens = worlds["d"], worlds["tokens"]
    assert latest_iteration(d / "trained") == 3
    assert export_main(["--load", str(d / "trained"), "--output", str(d / "hf_trained")]) == 0
    assert "saved at tp=2 x dp=2, ZeRO stage 3" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(str(d / "hf_trained")).eval()
    assert (hf.config.activation_function == "gelu"
            and hf.config.eos_token_id == Tokenizer(worlds["tok"]).eod)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied stays tied
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
        loss = hf(tokens, labels=tokens).loss
    ours = worlds["trained"]
    diff = (logits - ours["logits"]).abs().max().item()
    print(f"export: max |logits diff| = {diff:.3e}, loss diff = "
          f"{abs(loss.item() - ours['losses'].mean().item()):.3e}")
    torch.testing.assert_close(logits, ours["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ours["losses"].mean(), rtol=0, atol=1e-5)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_hf(d / "trained", d / "hf_trained")


@pytest.mark.timeout(600)
def test_init_from_hf_at_tp2_dp2_gives_transformers_loss_and_exports_back_bitwise(worlds):
    d, tokens, hf = worlds["d"], worlds["tokens"], worlds["hf_model"]
    with torch.no_grad():
        loss = hf(tokens, labels=tokens).loss
    ours = worlds["imported"]["losses"].mean()
    print(f"import: loss diff = {abs(loss.item() - ours.item()):.3e}")
    torch.testing.assert_close(ours, loss, rtol=0, atol=1e-5)
    export_hf(d / "imported", d / "hf_again")
    original, again = (load_file(str(d / "gpt2" / "model.safetensors")),
                       load_file(str(d / "hf_again" / "model.safetensors")))
    assert set(original) == set(again)
    for key, t in original.items():
        assert torch.equal(again[key], t), key


@pytest.mark.timeout(600)
def test_generate_is_deterministic_and_reads_checkpoints(worlds, capsys):
    d = worlds["d"]
    hf_dir = d / "hf_gen"
    if not hf_dir.exists():
        export_hf(d / "trained", hf_dir)
    argv = ["--prompt", "Return the", "--max-new-tokens", "20", "--temperature", "0.9", "--top-k",
            "20", "--seed", "4"]
    outs = []
    for source in (["--hf-dir", str(hf_dir)], ["--hf-dir", str(hf_dir)],
                   ["--load", str(d / "trained")]):
        assert generate_main(source + argv) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].startswith("Return the")
    assert generate_main(["--hf-dir", str(hf_dir), "--max-new-tokens", "100"]) == 2
    assert "exceed the model's 64 positions" in capsys.readouterr().err


def test_generate_names_a_training_checkpoint_and_export_a_missing_directory(tmp_path, capsys):
    """``--hf-dir`` given a training checkpoint (no config.json) says so and names the commands
    that read one, instead of blaming a tokenizer; ``export_hf --load`` of a missing directory
    says it does not exist."""
    ck = tmp_path / "ck"
    (ck / "iter_0000010").mkdir(parents=True)
    (ck / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert generate_main(["--hf-dir", str(ck)]) == 2
    assert capsys.readouterr().err == (
        f"generate: error: --hf-dir {ck} is a training checkpoint (no config.json), not a "
        f"Hugging Face model directory: sample from it with --load {ck}, or export it once with "
        f"python -m hybrid.export_hf --load {ck} --output HF_DIR\n")
    assert generate_main(["--hf-dir", str(tmp_path)]) == 2
    assert "has no config.json: not a Hugging Face model directory" in capsys.readouterr().err
    gone = tmp_path / "gone"
    assert export_main(["--load", str(gone), "--output", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (f"export_hf: error: --load {gone}: no such directory (the "
                                       "--save directory of a training run)\n")
