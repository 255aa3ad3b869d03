"""Faults around the save directory: a full disk during a save (issue 27, kind 4); retention
after a roll back or in a used directory (kind 5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint.directory import (
    POINTER,
    latest_iteration,
    list_iterations,
    publish,
    shard_name,
    staging_dir,
)
from hybrid.checkpoint.retention import Retention, next_sequence, save_order
from hybrid.parallel.spawn import spawn_world
from tests.save_worlds import MOCK, disk_full_on, roll_back_and_resume, run_finished_again

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_disk_full_removes_the_partial_save_and_names_path_and_errno(tmp_path):
    """A synchronous save, and a background one (``--async-save``: reported when the ranks
    agree on publication, after the training went on)."""
    runs = []
    for name, extra in (("ck", []), ("ack", ["--async-save", "--save-interval", "4"])):
        save = ["--save", str(tmp_path / name)]
        runs.append((MOCK + ["--train-iters", "3"] + save,
                     MOCK + ["--train-iters", "6", "--load", str(tmp_path / name)] + save + extra))
    got = spawn_world(2, disk_full_on, runs, 1, timeout_s=60)
    for i, (name, it) in enumerate((("ck", 6), ("ack", 4))):
        ck = tmp_path / name
        partial = ck / f"iter_{it:07d}.tmp" / "rank_00001.safetensors.partial"
        for messages in got:  # every rank raised (none waits for the failed one), the same
            message = messages[i]
            assert message.startswith("errno=28 "), message
            assert "rank 1: errno 28 (ENOSPC)" in message and f"writing {partial}" in message
            assert f"removed the partial directory {partial.parent}" in message
            assert f"{partial}: No space left on device; its file needs " in message
            assert message.endswith(f"the previous checkpoint (iteration 3 in {ck}) is intact")
        assert not partial.parent.exists()
        assert latest_iteration(ck) == 3 and list_iterations(ck) == [3]
        assert (ck / "iter_0000003" / "metadata.json").is_file()
        assert sorted(p.name for p in ck.iterdir()) == ["iter_0000003",
                                                        "latest_checkpointed_iteration.txt"]


@pytest.mark.timeout(300)
def test_a_full_disk_under_the_launcher_is_one_line_and_exit_status_1(tmp_path):
    """A real full file system (a 600 KiB tmpfs: one 0.4 MB checkpoint of MOCK at 2 ranks fits,
    the second does not): the error line, exit status 1, and no ChildFailedError report from
    torchrun (it printed 40 lines after the error)."""
    full = tmp_path / "full"
    full.mkdir()

    def on_tmpfs(*cmd: str) -> list[str]:
        return ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=600k tmpfs "$0" && exec '
                '"$@"', str(full), *cmd]

    probe = subprocess.run(on_tmpfs("true"), capture_output=True)
    if probe.returncode:
        pytest.skip(f"no tmpfs mount here (unshare -rm): {probe.stderr[-200:]!r}")
    ck = full / "ck"
    argv = [sys.executable, "-m", "hybrid.pretrain", "--nproc-per-node", "2", *MOCK,
            "--train-iters", "4", "--save-interval", "2", "--save", str(ck)]
    out = subprocess.run(on_tmpfs(*argv), cwd=ROOT, capture_output=True, text=True, timeout=200,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    lines = [ln for ln in (out.stdout + out.stderr).splitlines()
             if not ln.startswith((" iteration", "hybrid-zero pretraining", "ZeRO stage",
                                     "hybrid-pretrain: note:"))]
    stage = ck / "iter_0000004.tmp"
    assert out.returncode == 1 and lines[:1] == [f" saved checkpoint at iteration 2 to {ck}"], lines
    assert len(lines) == 2, lines  # nothing after the error line
    assert lines[1].startswith(
        f"hybrid-pretrain: error: saving iteration 4 to {ck} failed (ranks 0, 1: errno 28 (ENOSPC)"
        f" writing {stage}/rank_00000.safetensors.partial (and the other ranks' files beside it):"
        " No space left on device; their files need "), lines
    assert lines[1].endswith(f" bytes); removed the partial directory {stage}; the previous "
                             f"checkpoint (iteration 2 in {ck}) is intact"), lines


def fake_publish(root: Path, iteration: int, keep=None) -> None:
    stage = staging_dir(root, iteration)
    stage.mkdir(parents=True)
    (stage / shard_name(0)).write_bytes(b"")
    publish(root, iteration, {}, 1, keep)


def test_retention_keeps_the_new_checkpoint_and_the_branch_rolled_back_from(tmp_path):
    for it in (100, 200, 300):
        fake_publish(tmp_path, it)
    assert next_sequence(tmp_path) == 4
    (tmp_path / POINTER).write_text("200\n")  # rolled back after a loss spike
    policy = Retention.at_start(tmp_path, 1, resumed=200)
    assert policy.kept_apart(tmp_path) == [300]
    fake_publish(tmp_path, 250, policy)
    assert list_iterations(tmp_path) == [250, 300] and latest_iteration(tmp_path) == 250
    fake_publish(tmp_path, 260, policy)
    assert list_iterations(tmp_path) == [260, 300] and latest_iteration(tmp_path) == 260
    fresh = Retention.at_start(tmp_path, 1, resumed=None)  # a new run in the used directory
    for it in (10, 20):
        fake_publish(tmp_path, it, fresh)
    assert list_iterations(tmp_path) == [20, 260, 300] and latest_iteration(tmp_path) == 20
    fake_publish(tmp_path, 5, 1)  # a bare count: the newest in save order survives
    assert list_iterations(tmp_path) == [5]


def test_save_order_ranks_unstamped_checkpoints_first_by_iteration(tmp_path):
    for it in (7, 3):
        fake_publish(tmp_path, it)
    for it in (7, 3):
        p = tmp_path / f"iter_{it:07d}" / "metadata.json"
        p.write_text(p.read_text().replace('"save_sequence"', '"other"'))  # an older format
    assert save_order(tmp_path) == {3: (0, 3), 7: (0, 7)}
    policy = Retention.at_start(tmp_path, 2, resumed=3)
    assert policy.kept_apart(tmp_path) == [7]
    fake_publish(tmp_path, 4, policy)
    fake_publish(tmp_path, 5, policy)
    assert list_iterations(tmp_path) == [4, 5, 7]


@pytest.mark.timeout(300)
def test_rolled_back_and_fresh_runs_keep_their_new_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    (seen,) = spawn_world(1, roll_back_and_resume, MOCK, ck, timeout_s=60)
    assert seen == [[2, 4, 6], [5, 6], [1, 5, 6]]
    assert latest_iteration(ck) == 1


@pytest.mark.timeout(300)
def test_a_finished_run_started_again_leaves_its_checkpoint_and_says_so(tmp_path, capfd):
    """Started again with --load of its own --save, a finished run saved its last iteration
    once more (on another grid, the checkpoint of another grid) without a word."""
    ck = str(tmp_path / "ck")
    before, after, iterations = spawn_world(1, run_finished_again, MOCK, ck, timeout_s=60)[0]
    assert after == before and iterations == [2]
    assert (f"nothing left to train: loaded iteration 2 of --train-iters 2; the checkpoint in "
            f"{ck} is left as it is") in capfd.readouterr().out


def test_the_start_up_line_names_what_a_rolled_back_run_may_overwrite(tmp_path):
    """After a roll back from 824 to 400 the line said "never deleting iterations [600, 800,
    824]", but the run saved 600 again (overwriting the abandoned one) and pruned it."""
    for it in (400, 600, 800, 824):
        fake_publish(tmp_path, it)
    (tmp_path / POINTER).write_text("400\n")
    policy = Retention.at_start(tmp_path, 1, resumed=400)
    line = policy.kept_apart_line(tmp_path, 400, train_iters=700)
    assert line == (f" --save-keep-last 1: {tmp_path} holds another branch of the run (saved "
                    "after the resumed iteration 400): iterations [600, 800, 824]; [800, 824] "
                    "never deleted by this job; [600] (within --train-iters 700) overwritten "
                    "if this job saves the same iteration, and then pruned as its own")
    fake_publish(tmp_path, 600, policy)
    fake_publish(tmp_path, 700, policy)
    assert list_iterations(tmp_path) == [700, 800, 824]  # what the line said
    assert policy.kept_apart_line(tmp_path, 400, 700).endswith(
        "iterations [800, 824] are never deleted by this job")
    assert Retention.at_start(tmp_path, 1, None).kept_apart_line(tmp_path, None, 10).endswith(
        "(found there by this fresh run): iterations [700, 800, 824] are never deleted by this job")


def test_the_start_up_line_has_no_empty_protected_list(tmp_path):
    """Every abandoned iteration within --train-iters: no "none never deleted" double negative."""
    for it in (50, 55, 60):
        fake_publish(tmp_path, it)
    (tmp_path / POINTER).write_text("50\n")
    policy = Retention.at_start(tmp_path, 1, resumed=50)
    assert policy.kept_apart_line(tmp_path, 50, train_iters=60) == (
        f" --save-keep-last 1: {tmp_path} holds another branch of the run (saved after the "
        "resumed iteration 50): iterations [55, 60]; [55, 60] (within --train-iters 60) "
        "overwritten if this job saves the same iteration, and then pruned as its own")


def test_a_run_that_does_not_resume_save_is_refused_before_overwriting_it(tmp_path):
    """A fresh run into a --save holding another run's checkpoints replaced them silently."""
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import ConfigError, validate
    from hybrid.job.resume_checks import check_save_dir

    ck, other = tmp_path / "ck", tmp_path / "other"
    for it in (2, 4):
        fake_publish(ck, it)
    staging_dir(ck, 6).mkdir()  # an unpublished save is no checkpoint

    def refusal(*flags: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(parse_config(MOCK + ["--save", str(ck), *flags]), world_size=1,
                     local_world_size=1)
        return str(e.value)

    head = f"--save {ck} holds the checkpoints of another run (iterations 2, 4, latest 4) that "
    tail = ("its saves would overwrite them. To continue that run {}; otherwise give another "
            "--save directory, or --overwrite-save to save into this one anyway")
    assert refusal() == head + "this run does not resume (no --load of it): " + tail.format(
        f"give --load {ck}")
    assert refusal("--load", str(other)) == (
        head + f"this run does not resume (it loads --load {other}, another directory): "
        + tail.format(f"give --load {ck}"))
    resumed = ["--save", str(ck), "--load", str(tmp_path / "x" / ".." / "ck")]
    with pytest.raises(ValueError, match=r"\(--finetune restarts at iteration 0\): .* To "
                                         "continue that run drop --finetune;"):
        check_save_dir(parse_config(MOCK + resumed + ["--finetune"]))
    for fine in ([], ["--no-load-optim", "--no-load-rng"], ["--finetune", "--overwrite-save"]):
        check_save_dir(parse_config(MOCK + resumed + fine))  # a resume; or said so
    check_save_dir(parse_config(MOCK + ["--save", str(ck), "--overwrite-save"]))
    check_save_dir(parse_config(MOCK + ["--save", str(other)]))  # empty or absent: nothing to lose
    (ck / POINTER).unlink()  # iterations without a pointer: --load of them starts from scratch
    with pytest.raises(ValueError, match=rf"iterations 2, 4\) .* \(no {POINTER} names one to "
                                         rf"resume\): .* write the iteration to resume into "
                                         rf"{ck / POINTER};"):
        check_save_dir(parse_config(MOCK + resumed))


def test_a_full_disk_while_writing_the_pointer_or_metadata_names_the_file(tmp_path, monkeypatch):
    """The pointer and metadata.json are written by rank 0 alone; a full disk there said
    "errno 28" without a file, and left the temporary file behind."""
    import errno

    import hybrid.checkpoint.directory as directory

    pointer = tmp_path / POINTER
    pointer.write_text("2\n")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as file.write / fsync raise it

    monkeypatch.setattr(directory.os, "fsync", full)
    with pytest.raises(OSError) as e:
        directory.write_file_atomic(pointer, b"4\n")
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == f"{pointer}.tmp{os.getpid()}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER] and pointer.read_text() == "2\n"
