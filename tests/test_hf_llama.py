"""Llama / Qwen2 / Qwen3 in and out of Hugging Face, against transformers' own classes.

Tolerances: the first-iteration loss of ``--init-from-hf`` (tp1 x dp1, and tp2 x dp2 ZeRO-3)
against transformers' forward on the same tokens, and the logits of an export against our
distributed model, agree to 1e-5 relative in fp32 (the same arithmetic, summed in another
order across TP ranks and micro-batches). Weights that only move between layouts (HF -> our
checkpoint -> HF) are compared bitwise.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import HARD_TEXTS, byte_bpe_tokenizer  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from data.hf_tokenizer import HFTokenizer  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from hybrid.hf.export import export_hf  # noqa: E402
from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import validate  # noqa: E402
from hybrid.job.datasets import build_datasets  # noqa: E402
from hybrid.parallel.spawn import spawn_world  # noqa: E402
from hybrid.training import TrainState  # noqa: E402
from tests.data_helpers import tiny_corpus, write_jsonl  # noqa: E402
from tests.hf_worlds import run_and_evaluate  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
FAMILIES = {  # model_type -> (class, config, our flags); vocab: Qwen2 has rows beyond its tokens
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SHAPE, vocab_size=400,
                                                      rope_parameters=LLAMA3_ROPE,
                                                      tie_word_embeddings=False),
              ["--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "8",
               "--untie-embeddings-and-output-weights", "--vocab-size", "400"]),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SHAPE, vocab_size=512,
                                                      tie_word_embeddings=False),
              ["--add-qkv-bias", "--untie-embeddings-and-output-weights", "--vocab-size", "512"]),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**SHAPE, vocab_size=400, head_dim=32,
                                                      tie_word_embeddings=True),
              ["--qk-layernorm", "--kv-channels", "32", "--vocab-size", "400"]),
}
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
         "--seq-length", "32", "--max-position-embeddings", "16384", "--position-embedding-type",
         "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--norm-epsilon", "1e-5"]


def random_hf(family: str, directory: Path, seed: int = 0, dtype=torch.float32):
    """A transformers model of ``family`` with every tensor random, saved sharded (index) in
    ``dtype``; returned in fp32."""
    cls, config, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(dtype).save_pretrained(str(directory), max_shard_size="60KB")
    model.float()
    assert (directory / "model.safetensors.index.json").is_file()
    return model


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def first_batch(argv: list[str], world: int) -> torch.Tensor:
    """The tokens ``[gbs, s + 1]`` of iteration 1 (samples 0 .. gbs-1, Megatron-LM's order)."""
    cfg = parse_config(argv)  # read after the run saved: its --save is no new run's
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=None))
    job = validate(cfg, world_size=world)
    train = build_datasets(job, TrainState())[0]
    return torch.stack([train[i]["tokens"] for i in range(job.global_batch_size)]).long()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_llama")
    texts = [json.loads(line)["text"] for line in tiny_corpus(d, 60_000).read_text().splitlines()]
    tok = byte_bpe_tokenizer(d / "tok", texts + HARD_TEXTS, vocab_size=400, bos=True)
    preprocess([str(write_jsonl(d / "c.jsonl", texts + HARD_TEXTS))], d / "data", tok,
               append_eod=True, progress=False, cache_dir=str(d / "cache"))
    models = {f: random_hf(f, d / f, seed=i) for i, f in enumerate(FAMILIES)}
    random_hf("llama", d / "bf16", seed=9, dtype=torch.bfloat16)
    common = ["--split", "1", "--eval-iters", "0", "--micro-batch-size", "2", "--log-interval",
              "1", "--seed", "5", "--hidden-dropout", "0", "--attention-dropout", "0"]
    data = ["--data-path", f"{d}/data_text_document", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tok)]
    argv = {}
    for f, (_, _, flags) in FAMILIES.items():
        source = data if f == "llama" else ["--mock-data"]
        base = MODEL + flags + common + source + ["--init-from-hf", str(d / f)]
        argv[f, 1] = base + ["--global-batch-size", "4", "--train-iters", "1", "--lr", "0",
                             "--min-lr", "0", "--save", str(d / f"{f}_tp1")]
        argv[f, 4] = base + ["--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3",
                             "--tensor-model-parallel-size", "2", "--zero-stage", "3",
                             "--save", str(d / f"{f}_tp2")]
    argv["bf16", 1] = argv["llama", 1] + ["--init-from-hf", str(d / "bf16"), "--save",
                                          str(d / "bf16_tp1")]
    # the same Llama run with dropout on (later flags win): its export must match as well
    argv["dropout", 4] = argv["llama", 4] + ["--hidden-dropout", "0.1", "--attention-dropout",
                                             "0.1", "--save", str(d / "dropout_tp2")]
    tokens = torch.randint(0, 400, (2, 17), generator=torch.Generator().manual_seed(3))
    one = spawn_world(1, run_and_evaluate, [argv[f, 1] for f in (*FAMILIES, "bf16")], tokens,
                      timeout_s=300)[0]
    four = spawn_world(4, run_and_evaluate, [argv[f, 4] for f in (*FAMILIES, "dropout")],
                       tokens, timeout_s=300)[0]
    runs = {(f, 1): r for f, r in zip((*FAMILIES, "bf16"), one, strict=True)}
    runs.update({(f, 4): r for f, r in zip((*FAMILIES, "dropout"), four, strict=True)})
    return dict(d=d, tok=tok, models=models, argv=argv, runs=runs, tokens=tokens)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("world", [1, 4])
def test_first_iteration_loss_is_transformers_forward(setup, family, world):
    batch = first_batch(setup["argv"][family, world], world)
    with torch.no_grad():
        want = setup["models"][family](batch, labels=batch).loss
    got = torch.tensor(setup["runs"][family, world]["history"][0]["lm_loss"])
    print(f"parity {family} {'tp1 x dp1' if world == 1 else 'tp2 x dp2 ZeRO-3'}: "
          f"rel diff {rel(got, want):.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", [*FAMILIES, "dropout"])
def test_export_after_training_loads_exactly_and_gives_our_logits(setup, family):
    d = setup["d"]
    out = d / f"export_{family}"
    meta = export_hf(d / f"{family}_tp2", out, max_shard_size="100KB")
    assert "model.safetensors.index.json" in meta["files"] and len(meta["files"]) > 2
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    kind = "llama" if family == "dropout" else family
    assert type(model) is FAMILIES[kind][0]
    with torch.no_grad():
        logits = model.eval()(setup["tokens"][:, :-1]).logits
    ours = setup["runs"][family, 4]["logits"]
    if family == "dropout":  # dropout changed the training, so this is another model
        assert not torch.equal(ours, setup["runs"]["llama", 4]["logits"])
    print(f"export {family}: max rel logits diff {rel(logits, ours):.2e}")
    torch.testing.assert_close(logits, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    if kind == "llama":  # the HF tokenizer travels, its EOS is the generation config's
        tok = HFTokenizer(out)
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eod
        assert model.config.bos_token_id == tok.bos


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", [*FAMILIES, "bf16"])
def test_round_trip_hf_ours_hf_is_bitwise(setup, family):
    d = setup["d"]
    export_hf(d / f"{family}_tp1", d / f"again_{family}", max_shard_size="60KB",
              dtype="bfloat16" if family == "bf16" else "float32")
    original, again = read_all(d / family), read_all(d / f"again_{family}")
    assert sorted(original) == sorted(again)
    for key, t in original.items():
        assert again[key].dtype == t.dtype and torch.equal(again[key], t), key


@pytest.mark.timeout(900)
def test_generation_follows_the_tokenizer_bos(setup, capsys):
    from transformers import AutoTokenizer

    from hybrid.hf.generate import generate, prompt_ids
    from hybrid.hf.generate import main as generate_main

    d = setup["d"]
    export_hf(d / "llama_tp2", d / "gen_llama")  # the training tokenizer (BOS) travels
    no_bos = byte_bpe_tokenizer(d / "tok_no_bos", HARD_TEXTS * 3, vocab_size=300, bos=False)
    export_hf(d / "qwen2_tp2", d / "gen_qwen2", tokenizer_model=no_bos)
    for name, starts in (("gen_llama", "bos"), ("gen_qwen2", "eos")):
        tok = AutoTokenizer.from_pretrained(str(d / name))
        eos = json.loads((d / name / "generation_config.json").read_text())["eos_token_id"]
        ids = prompt_ids(tok, "def f(x):", eos)
        first = tok.bos_token_id if starts == "bos" else eos
        assert ids[0] == first and ids.count(eos) == (starts == "eos"), (name, ids)
        texts = [generate(str(d / name), "def f(x):", 8, temperature=0.8, seed=s)
                 for s in (1, 1, 2)]
        assert texts[0] == texts[1] and isinstance(texts[2], str)
    assert generate_main(["--load", str(d / "llama_tp2"), "--prompt", "def", "--max-new-tokens",
                          "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
