"""Megatron-LM's example-script flags get one of three answers (issue 26 item 4): their meaning
here, accepted without effect (one start-up note), or refused on one line naming the feature."""

from __future__ import annotations

import pytest
import torch

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.job.megatron_flags import translate
from hybrid.parallel.spawn import spawn_world
from hybrid.pretrain import pretrain as main
from tests.pretrain_worlds import run_configs

# examples/gpt3/train_gpt3_175b_distributed.sh of Megatron-LM, its flag blocks in order, the model
# shrunk (96 x 12288 -> 2 x 64, seq 2048 -> 32), the batch and iteration counts made small, mock
# data instead of its files, plus flags of its other examples that mean something here; its
# --ckpt-format torch_dist is refused here (test_a_megatron_checkpoint_format_is_refused_by_name)
GPT3_175B = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "3", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "3",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--mock-data", "--vocab-size", "512", "--split", "949,50,1",
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    "--use-mcore-models", "--distributed-backend", "nccl", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-activations",
    "--exit-signal-handler", "--no-masked-softmax-fusion",
]
OUT_OF_SCOPE = {  # the script's own, with its values, and a few of the Llama-3 8B FP8 example's
    ("--pipeline-model-parallel-size", "16"): "pipeline parallelism",
    ("--step-batch-size-schedule", "0:16 2.4B:320"): "a batch-size schedule",
    ("--context-parallel-size", "2"): "context parallelism",
    ("--fp8-format", "hybrid"): "FP8 training",
    ("--num-experts", "8"): "mixture of experts",
    ("--tokenizer-type", "TikTokenizer"): "only sentencepiece",
    # accepted without effect at Megatron-LM's default 'single' only (a fresh user found
    # 'cyclic' and 'external', which change the samples there, accepted as no-ops)
    ("--dataloader-type", "cyclic"): "only single (Megatron-LM's default sampler",
}


def test_each_out_of_scope_flag_is_refused_on_one_line_naming_its_feature():
    extra = [tok for (flag, value) in OUT_OF_SCOPE for tok in (flag, *value.split())]
    with pytest.raises(ConfigError) as e:
        parse_config(GPT3_175B + extra)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == len(OUT_OF_SCOPE), lines
    for line, ((flag, _), feature) in zip(lines, OUT_OF_SCOPE.items(), strict=True):
        assert line.strip().startswith(flag) and feature in line, line


def test_help_lists_every_megatron_flag_with_what_it_does_here(capsys):
    """``--help`` listed none of them, though the docs say it lists every flag."""
    import re

    from hybrid.job import megatron_flags as mf

    with pytest.raises(SystemExit) as e:
        parse_config(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    group = re.sub(r"\s+", "", text[text.index("Megatron-LM compatibility:"):])
    for flag in [*mf.MEANING, *mf.SIZE_ONE, *mf.NO_OP, *mf.REFUSED]:
        assert flag.replace("-", "") in group.replace("-", ""), flag
    for line in ("--use-distributed-optimizer --zero-stage 1 unless --zero-stage is given",
                 "--pipeline-model-parallel-size accepted at 1; above 1 refused: pipeline "
                 "parallelism is not supported here",
                 "--manual-gc accepted without effect",
                 "--num-experts refused: mixture of experts (MoE) is not supported here"):
        assert re.sub(r"\s+", "", line) in group, line
    assert parse_config(GPT3_175B).zero.stage == 1  # listed, and still translated


def test_a_megatron_checkpoint_format_is_refused_by_name():
    """``--ckpt-format torch_dist`` was accepted without effect: the run wrote this trainer's
    format, which Megatron-LM cannot load. Until a Megatron-LM format is implemented, asking for
    one is refused in one line naming what is implemented; no flag saves in the default."""
    assert parse_config([]).checkpoint.ckpt_format == "safetensors"
    for name, what in (("torch_dist", "Megatron-LM's distributed checkpoint format"),
                       ("torch", "Megatron-LM's legacy format"),
                       ("torch_dcp", "torch.distributed.checkpoint"),
                       ("fsdp_dtensor", "Megatron-FSDP"), ("zarr", "zarr"),
                       ("safetensor", "no such checkpoint format")):
        with pytest.raises(ConfigError) as e:
            validate(parse_config(GPT3_175B + ["--ckpt-format", name]))
        assert len(str(e.value).splitlines()) == 1
        assert str(e.value).startswith(f"--ckpt-format {name!r} (CheckpointConfig.ckpt_format): "
                                       ) and what in str(e.value), str(e.value)
        assert str(e.value).endswith("; implemented: safetensors (this trainer's format: one "
                                     "safetensors file per rank holding its ZeRO partition, read "
                                     "on any grid)"), str(e.value)
    validate(parse_config(GPT3_175B + ["--ckpt-format", "safetensors"]))


def test_megatron_flags_take_their_meaning_here():
    ignored: list[str] = []
    cfg = parse_config(GPT3_175B, ignored)
    assert cfg.zero.stage == 1 and cfg.zero.overlap_comm and cfg.zero.overlap_param_gather
    assert cfg.activation.selective_recompute
    assert parse_config(GPT3_175B + ["--zero-stage", "3"]).zero.stage == 3
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--distribute-saved-activations"]
    assert parse_config(full).activation.partition_activations  # Megatron's needs full too
    assert ignored == ["--attention-backend auto", "--use-mcore-models",
                       "--distributed-backend nccl", "--no-masked-softmax-fusion"]
    assert translate(["--tokenizer-type", "GPTSentencePieceTokenizer"]) == (
        ["--tokenizer-type", "GPTSentencePieceTokenizer"], [])
    rope = ["--use-rotary-position-embeddings", "--no-position-embedding"]
    assert parse_config(rope).model.position_embedding_type == "rope"
    assert parse_config(["--no-position-embedding"]).model.position_embedding_type == "none"
    assert translate(["--no-query-key-layer-scaling"]) == ([], ["--no-query-key-layer-scaling"])
    with pytest.raises(ConfigError, match="RoPE sequence-length interpolation"):
        translate(["--rotary-seq-len-interpolation-factor", "2"])
    both = ["--recompute-activations", "--recompute-granularity", "selective"]
    assert parse_config(both).activation.selective_recompute
    with pytest.raises(ConfigError, match="--recompute-activations is selective recompute"):
        translate(["--recompute-activations", "--recompute-granularity", "full"])


@pytest.mark.timeout(200)
def test_the_shrunk_gpt3_script_trains(capfd, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"  # the script's --tensorboard-dir: the records' numbers as scalars
    (history,) = spawn_world(1, run_configs, [GPT3_175B + ["--tensorboard-dir", str(tb)]],
                             timeout_s=120)[0]
    train = [r for r in history if "split" not in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    events = EventAccumulator(str(tb))
    events.Reload()
    for tag, key in (("lm loss", "lm_loss"), ("learning-rate", "lr"), ("grad-norm", "grad_norm")):
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [r["iteration"] for r in train]
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in train],
                                                           rel=1e-6)  # stored as float32
    valid = [r for r in history if r.get("split") == "valid"]
    assert [e.step for e in events.Scalars("lm loss validation")] == [r["iteration"]
                                                                      for r in valid]
    # the dry run of the same flags prints the one note of flags without effect
    assert main(GPT3_175B + ["--dry-run-world-size", "1"]) == 0
    out = capfd.readouterr().out
    assert out.count("accepted without effect here") == 1
    assert "--use-mcore-models, --distributed-backend nccl" in out


@pytest.mark.parametrize("flag,hint", [
    ("--num-layer", "--num-layers"), ("--zero", "--zero-stage"), ("--train_iters", "--train-iters"),
    ("--swiglu-gated", None), ("--foo-bar", None), ("--checkpoint-num-layers",
                                                    "--recompute-num-layers"),
])
def test_an_unknown_flag_is_hinted_only_when_plausibly_the_same_flag(flag, hint):
    with pytest.raises(ConfigError) as e:
        validate(parse_config([flag, "2"]), world_size=1)
    assert ("did you mean" in str(e.value)) == (hint is not None), str(e.value)
    if hint:
        assert f"did you mean {hint}?" in str(e.value)


def test_vocab_and_merge_files_give_the_gpt2_bpe_vocabulary(tmp_path):
    """The script's --vocab-file / --merge-file (data preprocessed with Megatron-LM's
    GPT2BPETokenizer): the vocabulary size is that of transformers' GPT2TokenizerFast built
    from the same files."""
    import json

    from transformers import GPT2TokenizerFast

    vocab, merges = tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "<|endoftext|>": 5}))
    merges.write_text("#version: 0.2\na b\nab c\n")
    files = ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    base = [a for a in GPT3_175B if a not in ("--vocab-size", "512")]
    job = validate(parse_config(base + files + ["--tokenizer-type", "GPT2BPETokenizer"]),
                   world_size=1)
    hf = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))
    assert job.gpt.vocab_size == len(hf) == 6 and hf("abc")["input_ids"] == [4]
    with pytest.raises(ConfigError, match="needs both --vocab-file and --merge-file"):
        validate(parse_config(base + files[:2]), world_size=1)
    with pytest.raises(ConfigError, match="--vocab-size 7 does not match the vocabulary of 6"):
        validate(parse_config(base + files + ["--vocab-size", "7"]), world_size=1)


# examples/llama/train_llama3_8b_h100_fp8.sh of Megatron-LM, its mock-data branch, shrunk, less the
# Llama-family model flags (--swiglu, --normalization, --group-query-attention, rotary, ...: the
# model issue's); its flags for features this trainer does not have, each with its feature
LLAMA3_8B = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.0134",
    "--attention-backend", "fused", "--untie-embeddings-and-output-weights",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "12",
    "--lr-decay-samples", "10", "--lr-warmup-samples", "2", "--lr", "0.00015", "--min-lr",
    "0.00001", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion",
    "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1", "--log-interval", "1", "--eval-iters", "2",
    # the recipe flags that now have their meaning here (issue 36)
    "--apply-layernorm-1p", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--calculate-per-token-loss",
]
LLAMA3_OUT_OF_SCOPE = [
    ("--fp8-format hybrid", "FP8 training"), ("--fp8-amax-history-len 1024", "FP8 training"),
    ("--fp8-amax-compute-algo max", "FP8 training"), ("--fp8-param-gather", "FP8 training"),
]


def test_zero_engine_flags_have_megatron_names_defaults_and_rules():
    """Issue 33: --gradient-accumulation-fusion (default on), --overlap-grad-reduce (on here:
    ZeRO-2/3 memory), --overlap-param-gather (default off, needs stage >= 1 and the reduce
    overlap) and --grad-reduce-in-bf16 (default off, --bf16 only), refused in one line."""
    z = parse_config([]).zero
    assert z.gradient_accumulation_fusion and z.overlap_comm
    assert not z.overlap_param_gather and not z.grad_reduce_in_bf16
    z = parse_config(["--no-gradient-accumulation-fusion", "--no-overlap-grad-reduce"]).zero
    assert not z.gradient_accumulation_fusion and not z.overlap_comm
    z = parse_config(["--bf16", "--grad-reduce-in-bf16", "--overlap-param-gather"]).zero
    assert z.grad_reduce_in_bf16 and z.grad_dtype == torch.bfloat16 and z.overlap_param_gather
    for argv, words in ((["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 True"),
                        (["--overlap-param-gather", "--zero-stage", "0"], "stage 0 gathers"),
                        (["--overlap-param-gather", "--no-overlap-grad-reduce"],
                         "needs --overlap-grad-reduce")):
        with pytest.raises(ConfigError, match=words):
            parse_config(argv)


def test_start_up_line_says_what_each_gradient_and_gather_path_is():
    from hybrid.zero.accounting import engine_modes

    line = engine_modes(parse_config([]).zero)
    for words in ("gradients fp32", "main-grad buffer (--gradient-accumulation-fusion)",
                  "during backward (--overlap-grad-reduce)", "(--overlap-param-gather off)"):
        assert words in line, line
    line = engine_modes(parse_config(["--bf16", "--grad-reduce-in-bf16", "--overlap-param-gather",
                                      "--no-gradient-accumulation-fusion"]).zero)
    for words in ("gradients bf16 (--grad-reduce-in-bf16)", "(--no-gradient-accumulation-fusion)",
                  "waited unit by unit in the next forward (--overlap-param-gather)"):
        assert words in line, line


@pytest.mark.timeout(200)
def test_the_shrunk_llama3_script_refuses_only_its_out_of_scope_flags_and_trains():
    with pytest.raises(ConfigError) as e:
        parse_config(LLAMA3_8B + [t for flag, _ in LLAMA3_OUT_OF_SCOPE for t in flag.split()])
    lines = str(e.value).splitlines()[1:]
    assert [line.strip().split(":")[0] for line in lines] == [f.split()[0]
                                                               for f, _ in LLAMA3_OUT_OF_SCOPE]
    assert all(feature in line for line, (_, feature) in zip(lines, LLAMA3_OUT_OF_SCOPE,
                                                             strict=True))
    (history,) = spawn_world(1, run_configs, [LLAMA3_8B], timeout_s=120)[0]
    # --train-samples 12 at global batch 4: 3 iterations, as Megatron-LM's update_train_iters
    assert [r["iteration"] for r in history if "split" not in r] == [1, 2, 3]
