"""Stopping a run (issue 13 item 3): SIGTERM and ``--exit-duration-in-mins`` stop the run at the
first iteration past them with or without ``--save``, and the time limit counts from the process
start (model build, data indexing and wandb start-up included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.job.preemption import StopSignal
from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import printed_sigterm_in_evaluation, run_configs, sigterm_at

ROOT = Path(__file__).resolve().parents[1]
MOCK = ["--mock-data", "--vocab-size", "500", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--log-interval", "1", "--eval-iters", "0", "--train-iters", "40"]


def test_the_limit_counts_from_the_process_start():
    code = ("import time; time.sleep(1.5); from hybrid.job.preemption import process_start; "
            "print(time.monotonic() - process_start())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    assert 1.5 <= float(out.stdout) < 30
    stop = StopSignal(2.0 / 60, signals=())  # 2 s since this (older) test process started
    assert stop.should_stop("cpu")
    assert not StopSignal(2.0 / 60, signals=(), start=time.monotonic()).should_stop("cpu")


def iterations(history) -> list[int]:
    return [r["iteration"] for r in history if "split" not in r]


@pytest.mark.timeout(200)
def test_sigterm_and_time_limit_stop_without_save(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    (timed,) = spawn_world(1, run_configs, [MOCK + ["--exit-duration-in-mins", "0.0001"]],
                           timeout_s=60)[0]
    assert iterations(timed) == [1]
    termed = spawn_world(2, sigterm_at, MOCK + ["--global-batch-size", "4"], 3, timeout_s=60)
    assert [iterations(h) for h in termed] == [[1, 2, 3], [1, 2, 3]]
    assert signal.getsignal(signal.SIGTERM) == before
    assert not list(tmp_path.iterdir())  # nothing saved anywhere we own


@pytest.mark.timeout(300)
def test_sigterm_during_a_long_evaluation_stops_within_one_batch_and_saves(tmp_path):
    # issue 27 kind 2: SIGTERM during a 10,000-batch validation waited for all of it
    from hybrid.checkpoint.directory import latest_iteration, read_metadata

    ck = tmp_path / "ck"
    argv = MOCK + ["--global-batch-size", "4", "--eval-interval", "2", "--eval-iters", "5000",
                   "--save", str(ck)]
    runs = spawn_world(2, printed_sigterm_in_evaluation, argv, 3, timeout_s=60)
    for rank, (history, counts, lines) in enumerate(runs):
        assert iterations(history) == [1, 2]
        assert not [r for r in history if "split" in r]  # the partial evaluation is dropped
        assert counts == [3]  # the signal came with batch 3: its forward, then the stop
        # and the line says so (it named only the save)
        assert [x for x in lines if "exiting" in x] == ([] if rank else [
            " exiting at iteration 2: received SIGTERM; dropped the validation at iteration 2; "
            f"saved checkpoint at iteration 2 to {ck}"]), lines
    assert latest_iteration(ck) == 2
    meta = read_metadata(ck, 2)
    assert meta["train_state"]["consumed_valid_samples"] == 5000 * 4  # as if it had finished


@pytest.mark.timeout(300)
def test_sigterm_during_the_final_evaluation_is_one_line(tmp_path):
    # exited 0 without a line: the stop dropped the final evaluations silently
    from hybrid.checkpoint.directory import latest_iteration

    ck = tmp_path / "ck"
    argv = MOCK + ["--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "3000",
                   "--save", str(ck)]
    runs = spawn_world(2, printed_sigterm_in_evaluation, argv, 3, timeout_s=60)
    for rank, (history, counts, lines) in enumerate(runs):
        assert iterations(history) == [1, 2] and not [r for r in history if "split" in r]
        assert counts == [3]  # the final validation stopped at batch 3; no test evaluation
        exiting = [x for x in lines if "exiting" in x]
        assert exiting == ([] if rank else [
            " exiting at iteration 2: received SIGTERM; dropped the final validation and test "
            f"evaluations; the checkpoint at iteration 2 in {ck} was saved before them"]), lines
    assert latest_iteration(ck) == 2


@pytest.mark.timeout(200)
def test_exit_interval_saves_and_exits_after_a_multiple_of_n(tmp_path):
    # Megatron-LM's --exit-interval was refused as unknown ("did you mean --save-interval")
    from hybrid.checkpoint.directory import latest_iteration
    from hybrid.config_fields import ConfigError
    from hybrid.job.cli import parse_config
    from tests.pretrain_worlds import printed_run

    ck = tmp_path / "ck"
    argv = MOCK + ["--exit-interval", "3", "--save-interval", "2", "--save", str(ck)]
    ((history, lines),) = spawn_world(1, printed_run, argv, timeout_s=60)
    assert iterations(history) == [1, 2, 3] and latest_iteration(ck) == 3
    assert [x for x in lines if "exiting" in x] == [
        f" exiting at iteration 3: reached --exit-interval (3); saved checkpoint at iteration 3 "
        f"to {ck}"]
    with pytest.raises(ConfigError, match="--exit-interval 0 .*must be an integer >= 1"):
        parse_config(MOCK + ["--exit-interval", "0"])


@pytest.mark.timeout(400)
def test_closed_engine_releases_its_process_groups():
    # The engine's gradient hooks close a cycle through autograd that gc cannot see; the
    # process groups it references (and gloo's threads) then outlived destroy_process_group.
    from tests.pretrain_worlds import engine_lifetime

    argv = MOCK + ["--train-iters", "1", "--global-batch-size", "4"]
    # reducer + gatherer hooks
    got = spawn_world(2, engine_lifetime, argv + ["--zero-stage", "3"], timeout_s=120)
    assert got == [(False, True), (False, True)]


@pytest.mark.timeout(400)
def test_resumed_two_rank_runs_exit_zero(tmp_path):
    env = dict(os.environ, RUNS="2", LOG_DIR=str(tmp_path), PYTHON=sys.executable,
               PYTHONPATH=str(ROOT))
    out = subprocess.run(["bash", str(ROOT / "scripts" / "resume_exit_loop.sh")], env=env,
                         capture_output=True, text=True, timeout=380)
    assert (out.returncode == 0
            and "resumed runs that exited 0: 2 of 2" in out.stdout), out.stdout + out.stderr[-2000:]
