"""Changed settings on ``--load`` (issue 13 items 5 and 7): the LR schedule comes from the
checkpoint unless ``--override-opt-param-scheduler``; a changed data position, model shape or a
``--train-iters`` below the checkpoint is refused before any process group, naming old and new."""

from __future__ import annotations

import pytest

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.parallel.spawn import spawn_world
from hybrid.schedule import LRSchedule
from tests.pretrain_worlds import run_configs

MOCK = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--seed", "3"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Saved at 4 of 4; resumed to 8 with the checkpoint's schedule, this run's, and anew."""
    ck = str(tmp_path_factory.mktemp("sched") / "ck")
    histories = spawn_world(1, run_configs, [
        MOCK + ["--train-iters", "4", "--save", ck],
        MOCK + ["--train-iters", "8", "--load", ck, "--use-checkpoint-opt_param-scheduler"],
        MOCK + ["--train-iters", "8", "--load", ck, "--override-opt_param-scheduler"],
        MOCK + ["--train-iters", "8", "--load", ck, "--no-load-optim"],
    ], timeout_s=150)[0]
    return ck, histories


def lrs(history) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in history if "split" not in r}


@pytest.mark.timeout(200)
def test_schedule_comes_from_the_checkpoint_unless_overridden(resumed):
    _, (first, kept, overridden, restarted) = resumed
    # lengths in samples (global batch 4); iteration i trains after i - 1 steps
    saved = LRSchedule(3e-3, 3e-4, 1 * 4, 4 * 4, "linear")
    assert lrs(first) == {i: saved(4 * (i - 1)) for i in range(1, 5)}
    assert lrs(first)[1] == 0.0  # --lr-warmup-init's default, as Megatron-LM
    # the checkpoint's schedule (decay over 4 steps) ends at min-lr: no jump back up
    assert lrs(kept) == {i: 3e-4 for i in range(5, 9)}
    fresh = LRSchedule(3e-3, 3e-4, 1 * 4, 8 * 4, "linear")
    assert lrs(overridden) == {i: fresh(4 * (i - 1)) for i in range(5, 9)}
    assert lrs(overridden)[5] > 1e-3  # the jump, asked for explicitly
    # --no-load-optim: Megatron-LM loads no scheduler state, its schedule starts again
    assert lrs(restarted) == {i: fresh(4 * (i - 5)) for i in range(5, 9)}


def check(argv):
    return validate(parse_config(argv), world_size=1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("change,message", [
    (["--hidden-size", "128"], r"--hidden-size 64 in the checkpoint, 128 here;.* first differing "
                               r"parameter \S+: \(1000, 64\) in the checkpoint, \(1000, 128\) "
                               r"here"),
    (["--num-layers", "3"],
     "--num-layers 2 in the checkpoint, 3 here; first differing parameter layers.2"),
    (["--train-iters", "3"],
     r"--train-iters 3 is below the iteration of the checkpoint in --load \S+ \(4\)"),
    (["--seq-length", "64"],
     r"--seq-length 64 differs from the checkpoint's 32 .*16 consumed samples"),
    (["--split", "90,8,2"], "--split 90,8,2 differs from the checkpoint's 969,30,1"),
    (["--seed", "4"], "--seed 4 differs from the checkpoint's 3"),
    # a resume names the data position first; a finetune (new data order) the position table
    (["--seq-length", "16", "--max-position-embeddings", "16"],
     r"--seq-length 16 differs from the checkpoint's 32"),
    (["--finetune", "--seq-length", "128", "--max-position-embeddings", "128"],
     r"--seq-length 128 is longer than the position table of the model in --load \S+ \(64 "
     r"positions.*give --seq-length 64 or less"),
    # Megatron-LM asserts on a changed schedule without one of its two flags
    ([], r"schedule differs from the one of the checkpoint in --load \S+ \(iteration 4; "
         r"checkpoint -> this run: decay samples 16 -> 32\). Pass "
         r"--use-checkpoint-opt_param-scheduler .* or --override-opt-param-scheduler"),
    (["--lr", "1e-3", "--lr-decay-iters", "4"], r"checkpoint -> this run: --lr 0.003 -> 0.001\)"),
    (["--finetune", "--seq-length", "16", "--max-position-embeddings", "16"],
     r"--max-position-embeddings 64 in the checkpoint, 16 here; --max-position-embeddings defaults "
     r"to --seq-length: give --max-position-embeddings 64 "),
])
def test_contradicting_the_checkpoint_fails_before_any_process_group(resumed, change, message):
    ck, _ = resumed
    with pytest.raises(ConfigError, match=message):
        check(MOCK + ["--train-iters", "8", "--load", ck] + change)


@pytest.mark.timeout(200)
def test_allowed_changes_on_resume(resumed):
    ck, _ = resumed
    # another global batch changes the schedule's lengths in samples (Megatron-LM's unit)
    check(MOCK + ["--train-iters", "8", "--load", ck, "--hidden-dropout", "0.2",
                  "--global-batch-size", "8", "--use-checkpoint-opt_param-scheduler"])
    check(MOCK
          + ["--train-iters", "2", "--load", ck, "--finetune", "--seq-length", "64", "--seed", "9"])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        check(MOCK + ["--load", ck, "--override-opt-param-scheduler",
                      "--use-checkpoint-opt_param-scheduler"])


@pytest.mark.timeout(200)
def test_load_of_one_iteration_directory_names_the_root(resumed):
    """``--load ck/iter_0000004`` would find no checkpoint under it and start from scratch."""
    from pathlib import Path

    from hybrid.checkpoint.shards import CheckpointReader

    ck, _ = resumed
    it = str(Path(ck) / "iter_0000004")
    with pytest.raises(ConfigError,
                       match=rf"--load {it} is one iteration's directory.*give --load {ck} "):
        check(MOCK + ["--train-iters", "8", "--load", it])
    with pytest.raises(FileNotFoundError,
                       match=rf"give the checkpoint root {ck} and --iteration 4"):
        CheckpointReader(it)


def test_a_pointer_to_a_missing_iteration_is_a_config_error(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("99\n")
    with pytest.raises(ConfigError, match=rf"--load {tmp_path}: no checkpoint for iteration 99 "
                                          r".*available: \[\]"):
        check(MOCK + ["--train-iters", "8", "--load", str(tmp_path)])


def test_a_schedule_flag_or_no_load_optim_lets_a_changed_schedule_resume(resumed):
    ck, _ = resumed
    run = MOCK + ["--train-iters", "8", "--load", ck]
    for extra in (["--override-opt-param-scheduler"], ["--use-checkpoint-opt_param-scheduler"],
                  ["--no-load-optim"], ["--lr-decay-iters", "4"]):
        check(run + extra)
