"""``--save``'s lock at launch (issue 41 item 4; :mod:`hybrid.job.save_claim`): the launcher's
lock is rank 0's to take over, no other job's; a refusal inside the workers is one line and
exit status 2 from the launcher, the workers exiting 0 so that torchrun prints no report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint.lock import (
    INHERIT_ENV,
    LOCK_NAME,
    SaveDirectoryInUseError,
    SaveLock,
    pid_start_ticks,
    this_job,
)
from hybrid.job import launch as launcher
from hybrid.job.save_claim import REFUSAL_ENV, refused_in_worker
from tests.test_launch import BASE

ROOT = Path(__file__).resolve().parents[1]


def test_rank_0_takes_over_its_launchers_lock_and_no_other(tmp_path):
    launcher_pid = subprocess.Popen(["sleep", "100"])  # the launcher: a live job on this host
    record = dict(this_job(), pid=launcher_pid.pid, pid_start=pid_start_ticks(launcher_pid.pid),
                  token="the launcher's")
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    try:
        with pytest.raises(SaveDirectoryInUseError):
            SaveLock(tmp_path, inherit="another job's token")
        rank0 = SaveLock(tmp_path, inherit="the launcher's")
    finally:
        launcher_pid.kill()
        launcher_pid.wait()
    on_disk = json.loads((tmp_path / LOCK_NAME).read_text())
    assert on_disk["token"] == rank0.record["token"] and on_disk["pid"] == os.getpid()
    assert rank0.note is None  # a hand-over, not a dead job's lock taken over
    rank0.release()
    assert list(tmp_path.iterdir()) == []  # nothing left, no record beside it


def test_a_worker_refused_under_the_launcher_leaves_the_line_and_exits_0(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.delenv(REFUSAL_ENV, raising=False)
    assert refused_in_worker("--save x is in use", 0) == 2  # torchrun alone: rank 0 says it
    assert capsys.readouterr().err == "hybrid-pretrain: error: --save x is in use\n"
    assert refused_in_worker("--save x is in use", 1) == 2 and capsys.readouterr().err == ""
    refusal = tmp_path / "refusal"
    refusal.touch()
    monkeypatch.setenv(REFUSAL_ENV, str(refusal))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert refused_in_worker("--save x is in use", 3) == 0 and refusal.read_text() == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert refused_in_worker("--save x is in use", 2) == 0
    assert refusal.read_text() == "--save x is in use" and capsys.readouterr().err == ""


@pytest.mark.timeout(120)
def test_a_real_worker_refused_under_a_launcher_exits_0_without_a_word(tmp_path):
    """A worker (one process, as torchrun starts it) that finds ``--save`` held by a live job."""
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen(["sleep", "100"])
    (ck / LOCK_NAME).write_text(json.dumps(dict(this_job(), pid=holder.pid,
                                                pid_start=pid_start_ticks(holder.pid))))
    refusal = tmp_path / "refusal"
    refusal.touch()
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **{REFUSAL_ENV: str(refusal)})
        out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *BASE, "--train-iters",
                              "2", "--save", str(ck)], capture_output=True, text=True,
                             timeout=100, env=env)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 0 and "error" not in out.stdout + out.stderr, out.stderr[-3000:]
    assert refusal.read_text().startswith(f"--save {ck} is in use by another job: ")


def test_the_launcher_hands_its_lock_over_and_reports_a_refusal_in_one_line(tmp_path, capsys,
                                                                            monkeypatch):
    """torchrun faked: its workers find the launcher's lock token in their environment, and
    report a refusal through the file (as a job that took a multi-node job's lock would)."""
    ck = tmp_path / "ck"
    seen = {}

    def workers(cmd, save, per_node, env):
        seen["token"] = env[INHERIT_ENV]
        seen["lock"] = json.loads((ck / LOCK_NAME).read_text())["token"]
        monkeypatch.setenv(REFUSAL_ENV, env[REFUSAL_ENV])
        monkeypatch.setenv("LOCAL_RANK", "0")
        return refused_in_worker("--save ck is in use by another job: host h", 0)

    monkeypatch.setattr(launcher, "supervise", workers)
    assert launcher.launch(["--nproc-per-node", "2", *BASE, "--save", str(ck)]) == 2
    assert seen["token"] == seen["lock"]
    out = capsys.readouterr()
    assert out.err == "hybrid-pretrain: error: --save ck is in use by another job: host h\n"
    assert out.out == "" and not (ck / LOCK_NAME).exists()  # released by the launcher
    monkeypatch.setattr(launcher, "supervise", lambda *a: 0)  # no refusal: torchrun's status
    assert launcher.launch(["--nproc-per-node", "2", *BASE, "--save", str(ck)]) == 0
    assert capsys.readouterr().err == ""
