"""Start-up notes (issue 36): every Megatron-LM flag accepted without effect is named in one line,
and ``--sequence-parallel`` at tp 1 says it does nothing, as Megatron-LM warns."""

from __future__ import annotations

from hybrid.job.pretrain import _checked_job

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--train-iters", "1",
        "--eval-iters", "0"]


def test_sequence_parallel_at_tp1_and_flags_without_effect_are_noted(capsys):
    _checked_job(BASE + ["--sequence-parallel", "--distributed-backend", "nccl", "--manual-gc"])
    out = capsys.readouterr().out
    assert "--sequence-parallel has no effect at --tensor-model-parallel-size 1" in out
    assert "accepted without effect" in out and "--distributed-backend nccl" in out
    assert "--manual-gc" in out
    _checked_job(BASE + ["--log-throughput"])  # what every log line does: no note at all
    assert "accepted without effect" not in capsys.readouterr().out


def test_zeropp_quantizers_at_data_parallel_size_1_say_they_do_nothing(capsys):
    """The combination test's find: at tp = world (dp 1) qwZ and qgZ were accepted silently and
    trained bitwise as ZeRO without them."""
    world = ["--dry-run-world-size", "2", "--zero-stage", "3", "--bf16"]
    quantizers = ["--zero-quantized-weights", "--zero-quantized-gradients"]
    _checked_job(BASE + world + quantizers + ["--tensor-model-parallel-size", "2"])
    assert ("note: --zero-quantized-weights and --zero-quantized-gradients have no effect at "
            "data-parallel size 1") in capsys.readouterr().out
    _checked_job(BASE + world + quantizers)  # dp 2: they quantize
    assert "no effect at data-parallel size 1" not in capsys.readouterr().out


def test_a_profiler_flag_that_traces_nothing_says_so(capsys):
    """A fresh user's --profile-step-start 10 on a 2-iteration run wrote no trace, silently."""
    _checked_job(BASE + ["--profile", "--profile-step-start", "10", "--profile-step-end", "12"])
    assert "--profile-step-start 10 is after the last iteration (1)" in capsys.readouterr().out
    _checked_job(BASE + ["--use-pytorch-profiler"])
    assert "--use-pytorch-profiler has no effect without --profile" in capsys.readouterr().out


def test_a_split_without_validation_data_says_that_evaluation_will_not_run(capsys):
    """--split 100,0,0 with --eval-iters 5 skipped every evaluation without a word."""
    base = [a for a in BASE if a not in ("--eval-iters", "0")]
    _checked_job(base + ["--split", "100,0,0", "--eval-iters", "5"])
    assert capsys.readouterr().out.splitlines() == [
        "hybrid-pretrain: note: --split 100,0,0 gives the validation and test splits no share: "
        "there is no evaluation data, so --eval-iters 5 evaluates nothing (as Megatron-LM skips "
        "it). Give them a share (say --split 969,30,1) to evaluate, or --eval-iters 0"]
    _checked_job(base + ["--split", "99,0,1", "--eval-iters", "5"])
    assert "no validation runs (--eval-iters 5, --eval-interval); only the test split is " \
           "evaluated, at the end" in capsys.readouterr().out
    for quiet in (["--split", "100,0,0", "--eval-iters", "0"], ["--split", "99,1,0"]):
        _checked_job(base + quiet)
        assert "no share" not in capsys.readouterr().out


def test_the_default_zero_stage_says_it_is_zero1_where_megatron_means_ddp(capsys, tmp_path):
    """A Megatron-LM command without --use-distributed-optimizer is plain data parallelism;
    here it silently ran ZeRO-1 (the default --zero-stage)."""
    world = ["--dry-run-world-size", "4"]
    _checked_job(BASE + world)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "default --zero-stage" in x]
    assert line == ("hybrid-pretrain: note: ZeRO-1, the default --zero-stage: the fp32 master "
                    "and Adam moments are partitioned over the 4 data-parallel ranks (the same "
                    "losses as plain data parallelism, less memory); Megatron-LM without "
                    "--use-distributed-optimizer trains plain data parallelism, --zero-stage 0 "
                    "here")
    (tmp_path / "run.yaml").write_text("zero_stage: 2\n")
    for chosen in (["--zero-stage", "1"], ["--use-distributed-optimizer"],
                   ["--config", str(tmp_path / "run.yaml")], []):  # []: dp 1, nothing to say
        _checked_job(BASE + (world if chosen else []) + chosen)
        assert "default --zero-stage" not in capsys.readouterr().out, chosen
