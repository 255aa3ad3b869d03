"""Issue 28 item 7: the log line shows an ETA, the remaining iterations times the log window's
time per iteration plus the remaining evaluations at the time of the last one, and the JSON
record carries the same number (``eta_s``)."""

import dataclasses

from hybrid.metrics import format_eta, format_train_line
from hybrid.training import LoopSettings
from tests.test_training_loop import run


def test_format_eta():
    assert [format_eta(s) for s in (0, 59.4, 61, 3600, 3 * 3600 + 25 * 60 + 7)] == [
        "0:00:00", "0:00:59", "0:01:01", "1:00:00", "3:25:07"]
    assert format_eta(2 * 86400 + 5) == "2d 0:00:05"
    assert format_eta(-3) == "0:00:00"


def test_eta_is_remaining_iterations_at_the_windows_pace_plus_remaining_evaluations():
    # the fake clock advances 1 s per iteration and 100 s per evaluation; 6 iterations logged
    # every 3, an evaluation every 2 (at 2 and 4): at 3 one is left (at 4), at its measured
    # 100 s; the evaluation's time is not iteration time
    state, _ = run([5.0] * 6, log=3, eval=2)
    records = [r for r in state.history if "split" not in r]
    assert [(r["iteration"], r["eta_s"]) for r in records] == [(3, 103.0), (6, 0.0)]
    line = format_train_line(dict(records[0], memory_mb=1.0), 6)
    assert "| elapsed time per iteration (ms): 1000.0 | ETA: 0:01:43 | learning rate:" in line


def test_eta_names_the_evaluations_it_cannot_time_yet():
    """``--train-iters 40 --eval-iters 1000 --eval-interval 10`` showed ETA 0:00:01 at iteration
    10 while its evaluations took 30 s more: before one has run they are named, after it they
    are counted at its time."""
    state, _ = run([5.0] * 6, log=1, eval=2)
    records = [r for r in state.history if "split" not in r]
    assert [(r["iteration"], r["eta_s"], r.get("eta_evaluations")) for r in records] == [
        (1, 5.0, 2), (2, 4.0, 2), (3, 103.0, None), (4, 102.0, None), (5, 1.0, None),
        (6, 0.0, None)]
    line = format_train_line(dict(records[1], memory_mb=1.0), 6)
    assert "| ETA: 0:00:04 + 2 evaluations | learning rate:" in line
    loop = LoopSettings(train_iters=40, grad_accum_steps=1, global_batch_size=2,
                        tokens_per_step=8, log_interval=1, eval_interval=10, eval_iters=1000,
                        max_nan_iterations=10, flops_per_step=1.0, peak_tflops=None,
                        final_evaluations=2)
    # after iteration 10: the loop's at 10, 20, 30 (none at 40) and the final valid and test
    assert [loop.evaluations_left(i) for i in (1, 10, 11, 30, 31, 40)] == [5, 5, 4, 3, 2, 2]
    assert dataclasses.replace(loop, eval_iters=0).evaluations_left(10) == 0
    assert dataclasses.replace(loop, eval_interval=None).evaluations_left(10) == 2


def test_a_record_without_eta_keeps_megatrons_line():
    r = dict(iteration=1, consumed_samples=2, elapsed_ms=5.0, lr=1e-3, global_batch_size=2,
             lm_loss=1.0, loss_scale=1.0, grad_norm=1.0, skipped_iterations=0,
             nan_iterations=0, tokens_per_sec=1.0, tflops_per_device=0.0, memory_mb=1.0)
    assert "ETA" not in format_train_line(r, 10)


def test_the_eta_leaves_out_an_evaluation_split_that_is_skipped():
    """An empty test split (or one skipped for holding no document) is never evaluated: the
    ETA counts the final validation only; without a validation split, no evaluation at all."""
    import torch

    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.run import loop_settings

    job = validate(parse_config(["--num-layers", "2", "--hidden-size", "64",
                                 "--num-attention-heads", "4", "--seq-length", "32",
                                 "--mock-data", "--vocab-size", "500", "--micro-batch-size", "2",
                                 "--global-batch-size", "2", "--train-iters", "40",
                                 "--eval-iters", "5", "--eval-interval", "10"]), world_size=1)
    grid = type("Grid", (), {"device": torch.device("cpu")})()
    both = loop_settings(job, grid)
    assert [both.evaluations_left(i) for i in (10, 31)] == [5, 2]
    valid_only = loop_settings(job, grid, ("valid",))
    assert [valid_only.evaluations_left(i) for i in (10, 31)] == [4, 1]
    assert loop_settings(job, grid, ("test",)).evaluations_left(10) == 1
    assert loop_settings(job, grid, ()).evaluations_left(10) == 0
