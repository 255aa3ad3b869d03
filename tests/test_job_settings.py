"""Job settings and their errors (issue 13 items 4, 7, 10, 11): each case is the small input that
went wrong and the value that is right. No process group is started here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--mock-data", "--vocab-size", "500"]


def check(argv, world=2, local=None):
    return validate(parse_config(argv), world_size=world, local_world_size=local)


@pytest.mark.parametrize("fraction,iters", [(0.29, 100), (0.07, 300), (0.07, 10), (0.0, 10)])
def test_warmup_fraction_is_megatrons_unrounded_share_of_the_decay_samples(fraction, iters):
    d = check(BASE + ["--lr-warmup-fraction", str(fraction), "--train-iters", str(iters)])
    assert d.schedule["lr_warmup_steps"] == fraction * (iters * d.global_batch_size)


def quickstart_pretrain_flags(train_iters: int) -> list[str]:
    """The flags scripts/quickstart.sh passes to pretrain_gpt.sh, with ``TRAIN_ITERS`` set."""
    text = (ROOT / "scripts" / "quickstart.sh").read_text()
    block = re.search(r"bash scripts/pretrain_gpt\.sh \\\n(.*?)\"\$@\"", text, re.S).group(1)
    block = block.replace("\\\n", " ").replace("${TRAIN_ITERS:-300}", str(train_iters))
    flags = shlex.split(block)
    i = flags.index("--data-path")
    del flags[i:i + 4]  # data and tokenizer of the script's run directory -> mock data
    return flags + ["--mock-data", "--vocab-size", "4096"]


@pytest.mark.parametrize("train_iters", [1, 10, 300])
def test_quickstart_flags_are_valid_for_any_train_iters(train_iters):
    d = check(quickstart_pretrain_flags(train_iters), world=4, local=4)
    assert 0 <= d.warmup_iters <= train_iters


def test_bench_zero_report_without_matplotlib(tmp_path, monkeypatch, capsys):
    import builtins
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("bench_zero", ROOT / "scripts" / "bench_zero.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    run = dict(dp=4, ms_step_median=10.0, tokens_per_s=100.0, peak_rss_mib_per_rank=[300.0],
               state_mib_per_rank=[5.0], loss_final=6.0)
    results = {"ddp": run, "hybrid_z1": dict(run, ms_step_median=8.0)}
    args = types.SimpleNamespace(size="tiny", world=4, grad_reduce="reduce_scatter",
                                 native_collectives=False, reduce_bucket_size=50_000_000)
    bench.write_report(results, tmp_path, args, 3, 1)
    report = (tmp_path / "throughput_tiny_w4.md").read_text()
    assert "| hybrid_z1 | 0.80 |" in report and ".png" not in report
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("argv,message", [
    (["--zero", "3"], "unrecognized arguments: --zero 3; --zero: did you mean --zero-stage?"),
    (["--num-layer", "2"], "--num-layer: did you mean --num-layers?"),
    (["--hiden-size=64"], "--hiden-size: did you mean --hidden-size?"),
    (["--train-iter", "5"], "--train-iter: did you mean --train-iters?"),
])
def test_flags_are_never_abbreviated_and_a_typo_names_the_closest_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_flag_with_choices_given_without_a_value_lists_them():
    """``--kernel-fusion`` alone said only "expected one argument" (the usage, which lists the
    choices, is not printed); every flag with choices now names them, in the one line."""
    from hybrid.job.cli import build_parser

    with_choices = [a for a in build_parser()._actions if a.choices and a.option_strings]
    assert {"--kernel-fusion", "--lr-decay-style"} <= {a.option_strings[0] for a in with_choices}
    for action in with_choices:
        flag = action.option_strings[0]
        with pytest.raises(ConfigError) as e:
            parse_config(BASE + [flag])
        valid = ", ".join(map(str, action.choices))
        assert f"expected one argument; {flag}: valid values are {valid} (see --help)" in str(
            e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("local_rank,lines", [("0", 1), ("1", 0)])
def test_a_bad_flag_is_one_line_once_per_node(monkeypatch, capsys, local_rank, lines):
    from hybrid.pretrain import pretrain as main

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert main(BASE + ["--zero", "3"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == lines


def test_help_has_no_double_negatives_and_megatron_scheduler_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--no-no-" not in text and "--no-load-optim" in text and "--no-load-rng" in text
    assert ("--override-opt_param-scheduler" in text
            and "--use-checkpoint-opt_param-scheduler" in text)
    assert parse_config(BASE + ["--no-load-optim"]).checkpoint.no_load_optim
    assert parse_config(BASE
        + ["--override-opt_param-scheduler"]).checkpoint.override_opt_param_scheduler


@pytest.mark.parametrize("argv,world,message", [
    (["--tensor-model-parallel-size", "4"], 2,
     "tensor-model-parallel size 4 does not divide the world size 2; valid tensor-model-parallel "
     "sizes: [1, 2]"),
    (["--split", "0,1,0"], 2, "--split 0,1,0 gives the train split no share of the data"),
])
def test_errors_speak_of_this_project(argv, world, message):
    with pytest.raises(ConfigError) as e:
        check(BASE + argv, world=world)
    assert message in str(e.value) and "pipeline" not in str(e.value)


@pytest.mark.parametrize("flags,checkpointed", [
    ("--recompute-granularity full", 3),
    ("--checkpoint-activations", 3),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 3),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 2", 2),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 3", 3),
    ("--recompute-granularity full --recompute-method block", 3),
    ("", 0),
])
def test_megatron_core_recompute_flags(flags, checkpointed):
    cfg = parse_config(BASE + ["--num-layers", "3"] + flags.split())
    check(BASE + ["--num-layers", "3"] + flags.split())
    assert cfg.activation.num_checkpointed(3) == checkpointed


@pytest.mark.parametrize("flags,message", [
    ("--checkpoint-activations --checkpoint-num-layers 2",  # not a flag: an unknown one
     "unrecognized arguments: --checkpoint-num-layers 2; --checkpoint-num-layers: did you mean "
     "--recompute-num-layers?"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
     "--recompute-method uniform --recompute-num-layers 2 (one checkpoint per chunk of 2 blocks) "
     "is not implemented"),
    ("--recompute-method block --recompute-num-layers 2",
     "--recompute-method block --recompute-num-layers 2 needs --recompute-granularity full"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 4",
     "--recompute-num-layers 4 exceeds the model's --num-layers 3"),
    ("--recompute-granularity full --recompute-num-layers 0",
     "--recompute-num-layers 0 (ActivationConfig.recompute_num_layers): must be an integer >= 1"),
    ("--recompute-granularity coarse",
     "invalid choice: 'coarse' (choose from 'full', 'selective')"),
])
def test_recompute_errors_point_to_the_right_flags(flags, message):
    with pytest.raises(ConfigError) as e:
        check(BASE + ["--num-layers", "3"] + flags.split())
    assert message in str(e.value)
