"""Configuration: flags, config files and every consistency error before any process group."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.pretrain import pretrain as main
from tests.data_helpers import tiny_tokenizer, write_token_dataset

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--mock-data", "--vocab-size", "500"]


def check(argv, world=4, local=None):
    return validate(parse_config(argv), world_size=world, local_world_size=local)


def test_derived_batch_arithmetic():
    d = check(BASE + ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                      "--global-batch-size", "16"])
    assert (d.tp, d.dp, d.grad_accum_steps, d.tokens_per_step) == (2, 2, 4, 16 * 32)
    assert d.padded_vocab_size == 512
    assert "accumulation 4" in d.summary()


def test_preset_with_overrides():
    d = check(["--preset", "gpt2-124m", "--mock-data", "--vocab-size", "1000", "--num-layers", "2",
               "--seq-length", "128"], world=1)
    assert (d.gpt.num_layers, d.gpt.hidden_size, d.gpt.vocab_size) == (2, 768, 1000)
    assert d.gpt.max_position_embeddings == 1024


@pytest.mark.parametrize("extra,world,message", [
    (["--num-attention-heads", "6", "--hidden-size", "66", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 4,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8"),
    (["--tensor-model-parallel-size", "3"], 4, "tensor-model-parallel size 3"),
    (["--zero-stage", "4"], 4, "--zero-stage 4"),
    (["--seq-length", "4096", "--max-position-embeddings", "1024"], 4, "--seq-length 4096"),
    (["--bf16", "--fp16"], 4, "mutually exclusive"),
    (["--precision", "fp16", "--bf16"], 4, "--precision fp16 and --bf16 are mutually exclusive"),
    (["--fp16", "--precision", "bf16"], 4, "--fp16 and --precision bf16 are mutually exclusive"),
    (["--bf16", "--loss-scale", "128"], 4, "--loss-scale 128.0 .* fp16 only"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 4, "--min-lr"),
    (["--lr-warmup-iters", "500", "--train-iters", "100"], 4, "--lr-warmup-iters 500"),
    (["--split", "90,abc,5"], 4, "'abc' is not a non-negative number"),
    (["--partition-activations"], 4, "needs --checkpoint-activations"),
    (["--async-save"], 4, "--async-save needs --save DIR"),
    (["--preset", "gpt-5"], 4, "unknown model preset"),
    (["--fp16", "--initial-loss-scale", "1000"], 4, "power of two"),
    (["--data-path", "corpus_text_document"], 4,
     "--mock-data and --data-path corpus_text_document both name the training data"),
])
def test_each_bad_setting_names_its_values(extra, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check(BASE + extra, world=world)


def test_tp_group_spanning_nodes():
    with pytest.raises(ConfigError, match="span two nodes"):
        check(BASE + ["--tensor-model-parallel-size", "4"], world=8, local=2)


def test_a_data_path_with_its_extension_names_the_prefix_to_give(tmp_path):
    base = BASE[:-3] + ["--tokenizer-model", str(tiny_tokenizer(tmp_path)), "--split", "1"]
    prefix = write_token_dataset(tmp_path / "ds", [[1, 2, 3]] * 5)
    for ext in (".bin", ".idx"):
        with pytest.raises(ConfigError) as e:
            check(base + ["--data-path", f"{prefix}{ext}"])
        assert str(e.value) == (f"--data-path {prefix}{ext} names a file of the pair: give the "
                                f"prefix without the extension, --data-path {prefix}")
    (tmp_path / "ds.idx").unlink()
    with pytest.raises(ConfigError, match=rf"--data-path {prefix} \(which lacks {prefix}\.idx\)$"):
        check(base + ["--data-path", f"{prefix}.bin"])


def test_missing_data_files_and_tokenizer(tmp_path):
    base = BASE[:-3]  # without --mock-data --vocab-size
    with pytest.raises(ConfigError,
                       match=r"no training data given: give --data-path PREFIX .* or --mock-data"):
        check(base)
    # before the vocabulary
    with pytest.raises(ConfigError, match="--mock-data and --data-path x both name"):
        check(base + ["--mock-data", "--data-path", "x"])
    with pytest.raises(ConfigError, match=r"--tokenizer-model \(or --vocab-file and --merge-file\) "
                                          "is required"):
        check(base + ["--data-path", str(tmp_path / "x")])
    tok = tiny_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match=r"missing .*x\.bin"):
        check(base + ["--data-path", str(tmp_path / "x"), "--tokenizer-model", str(tok)])
    # data.preprocess --output-prefix P writes P_<key>_document: a bare P names that file
    write_token_dataset(tmp_path / "corpus_text_document", [[1, 2, 3]] * 5)
    with pytest.raises(ConfigError, match=r"missing \S+corpus\.bin, \S+corpus\.idx; .* did you "
                                          r"mean --data-path \S+corpus_text_document\?$"):
        check(base + ["--data-path", str(tmp_path / "corpus"), "--tokenizer-model", str(tok)])
    with pytest.raises(ConfigError, match=r"x\.bin, \S+x\.idx$"):  # nothing to suggest
        check(base + ["--data-path", str(tmp_path / "x"), "--tokenizer-model", str(tok)])
    with pytest.raises(ConfigError, match="file not found"):
        check(base + ["--data-path", str(tmp_path / "x"), "--tokenizer-model",
                      str(tmp_path / "nope.model")])
    prefix = write_token_dataset(tmp_path / "ds", [[1, 2, 3]] * 5)
    base = base + ["--split", "1"]
    with pytest.raises(ConfigError,
                       match="--vocab-size 500 does not match the tokenizer's vocabulary of 600"):
        check(base
              + ["--data-path", str(prefix), "--tokenizer-model", str(tok), "--vocab-size", "500"])
    d = check(base + ["--data-path", "1.0", str(prefix), "--tokenizer-model", str(tok)])
    assert d.gpt.vocab_size == 600
    # data made with a larger tokenizer: refused before training on wrong ids
    other = write_token_dataset(tmp_path / "other", [[1, 2, 3], [7, 31999, 4]] * 3)
    with pytest.raises(ConfigError, match=r"--data-path \S+other holds token id 31999, outside the "
                                          r"vocabulary \[0, 600\) of --tokenizer-model"):
        check(base + ["--data-path", str(other), "--tokenizer-model", str(tok)])


def test_training_loop_refuses_token_ids_outside_the_vocabulary():
    """The per-micro-batch check behind the start-up sample (ids past the sample)."""
    import torch

    from data.batches import checked_tokens

    good, bad = torch.tensor([[0, 5, 9]]), torch.tensor([[1, 10, 2]])
    assert [b.tolist() for b in checked_tokens([good, good], 10, ["ds"])] == [[[0, 5, 9]]] * 2
    with pytest.raises(ValueError,
                       match=r"token id 10 in --data-path ds is outside the vocabulary \[0, 10\)"):
        list(checked_tokens([good, bad], 10, ["ds"]))


def test_bad_yaml_and_dry_run_flags_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 2\n   hidden_size: 64\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 2, column 15\): mapping values"):
        parse_config(["--config", str(bad)])
    with pytest.raises(ConfigError,
                       match="--dry-run-world-size 0 must be a positive number of ranks"):
        check(BASE + ["--dry-run-world-size", "0"])
    with pytest.raises(ConfigError, match="--dry-run-rank 3 needs --dry-run-world-size"):
        check(BASE + ["--dry-run-rank", "3"])


def test_config_file_yaml_and_toml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  num_layers: 3\nlr: 3e-4\nnum-attention-heads: 4\ndata_path: 0.5 A 0.5 "
                 "B\n")
    cfg = parse_config(["--config", str(y), "--num-layers", "5"])
    assert cfg.model.num_layers == 5  # the command line wins
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.num_attention_heads == 4
    assert cfg.data.data_path == ["0.5", "A", "0.5", "B"]
    t = tmp_path / "c.toml"
    t.write_text('[zero]\nstage = 3\nbf16 = true\n[grid]\ntensor_model_parallel_size = 2\n')
    cfg = parse_config(["--config", str(t)])
    assert (cfg.zero.stage, cfg.grid.tensor_model_parallel_size, cfg.zero.precision) == (3, 2,
                                                                                         "bf16")
    old = tmp_path / "old.toml"  # sections of an older tree are not read by flag name
    old.write_text('[parallel]\nzero_stage = 3\ntensor_model_parallel_size = 2\n'
                   '[optim]\nbf16 = true\n')
    with pytest.raises(ConfigError,
                       match=r"unknown sections optim, parallel \(the sections are model, "):
        parse_config(["--config", str(old)])
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layer: 3\n")
    with pytest.raises(ConfigError, match=r"unknown field num_layer \(did you mean num_layers\?\)"):
        parse_config(["--config", str(bad)])


def test_main_returns_2_without_touching_torch_distributed(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(BASE + ["--tensor-model-parallel-size", "3"]) == 2
    assert "does not divide the world size 4" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_torchrun_workers_exit_nonzero_before_any_collective():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hybrid.pretrain", *BASE, "--num-attention-heads", "3", "--hidden-size", "66",
         "--tensor-model-parallel-size", "2"],
        capture_output=True, text=True, timeout=110, env=env, cwd=root)
    assert out.returncode != 0
    assert ("--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"
            in out.stderr)


def test_split_that_leaves_a_split_empty(tmp_path):
    """An evaluation split with no document of the (only) dataset is skipped, as in Megatron-LM
    (issue 28 item 6; tests/test_split_advice.py); an empty train split is an error."""
    tok = tiny_tokenizer(tmp_path)
    prefix = write_token_dataset(tmp_path / "ds", [[1, 2, 3]] * 20)
    argv = BASE[:-3] + ["--data-path", str(prefix), "--tokenizer-model", str(tok)]
    check(argv + ["--split", "949,50,1"])
    check(argv + ["--split", "949,50,1", "--eval-iters", "0"])
    check(argv + ["--split", "80,10,10"])
    with pytest.raises(ConfigError,
                       match=r"--split 1,999,0 leaves the train split .* \(20 documents\) empty"):
        check(argv + ["--split", "1,999,0"])


def test_component_configs_are_the_sections_and_flags_keep_megatron_names():
    from hybrid.activation.config import ActivationConfig
    from hybrid.job.cli import build_parser
    from hybrid.zero.config import OptimizerConfig, ZeroConfig

    cfg = parse_config(BASE + ["--bf16", "--zero-stage", "3", "--lr", "1e-3", "--adam-beta2",
                               "0.95", "--checkpoint-activations", "--initial-loss-scale", "65536"])
    assert isinstance(cfg.zero, ZeroConfig) and isinstance(cfg.optimizer, OptimizerConfig)
    assert isinstance(cfg.activation, ActivationConfig)
    assert (cfg.zero.stage, cfg.zero.precision, cfg.zero.initial_loss_scale) == (3, "bf16", 65536.0)
    plan = cfg.zero.plan
    assert plan.shards_parameters and plan.shards_gradients and plan.shards_optimizer_states
    assert (cfg.optimizer.lr, cfg.optimizer.adam_beta2) == (1e-3, 0.95)
    assert parse_config(BASE + ["--fp16"]).zero.precision == "fp16"
    assert parse_config(BASE).zero.precision == "fp32"
    helptext = build_parser().format_help()
    assert "--zero-stage" in helptext and "same as --precision bf16" in helptext
    # each section checks its own fields once, with the one error type, naming flag, field and value
    with pytest.raises(ConfigError, match=r"--adam-beta2 1\.0 \(OptimizerConfig\.adam_beta2\)"):
        parse_config(BASE + ["--adam-beta2", "1.0"])
    with pytest.raises(ConfigError,
                       match=r"--micro-batch-size 0 \(TrainingConfig\.micro_batch_size\)"):
        parse_config(BASE + ["--micro-batch-size", "0"])


def test_list_presets_and_generate_help_show_values(capsys):
    from hybrid.hf.generate import main as generate_main
    from hybrid.job.cli import build_parser
    from models.presets import get_preset, list_presets

    with pytest.raises(SystemExit) as stop:
        parse_config(["--list-presets"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["preset", "layers", "hidden", "heads", "params"]
    assert [line.split()[0] for line in lines[1:]] == list_presets()
    row = dict((line.split()[0], line.split()[1:]) for line in lines[1:])
    assert row["gpt2-124m"] == ["12", "768", "12", "0.124B"]  # GPT-2 small, tied embeddings
    c = get_preset("llama3-8b")
    assert row["llama3-8b"] == ["32", "4096", "32/8", f"{c.num_parameters() / 1e9:.3f}B"]
    assert row["llama3-8b"][3] == "8.030B"  # Meta's 8.03B
    assert "--list-presets" in build_parser().format_help()
    with pytest.raises(SystemExit) as stop:
        generate_main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 64)", "(default: 1.0)", "(default: 50)", "(default: 1234)",
                    "(default: the latest)", "(default: start a new document)"):
        assert default in text, default
    assert "(default: None)" not in text
