"""``--save``'s lock at launch (issue 41 item 4; :mod:`hybrid.job.save_claim`): the launcher's
lock is rank 0's to take over, no other job's; a refusal inside the workers is one line and
exit status 2 from the launcher, the workers exiting 0 so that torchrun prints no report
(:func:`hybrid.job.launch.worker_status`)."""

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


@pytest.mark.timeout(120)
def test_a_real_worker_refused_under_a_launcher_says_it_and_hands_status_2_over(tmp_path):
    """A worker (one process, as torchrun starts it) that finds ``--save`` held by a live job:
    its one line, exit 0 for torchrun, status 2 in the launcher's status file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen(["sleep", "100"])
    (ck / LOCK_NAME).write_text(json.dumps(dict(this_job(), pid=holder.pid,
                                                pid_start=pid_start_ticks(holder.pid))))
    status = tmp_path / "status"
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **{launcher.STATUS_FILE_ENV: str(status)})
        out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *BASE, "--train-iters",
                              "2", "--save", str(ck)], capture_output=True, text=True,
                             timeout=100, env=env)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 0 and status.read_text() == "2\n", out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"hybrid-pretrain: error: --save {ck} is in use by another job: "), out.stderr[-3000:]


def test_the_launcher_hands_its_lock_over_and_releases_it(tmp_path, capsys, monkeypatch):
    """torchrun faked: its workers find the launcher's lock token in their environment; the
    launcher returns the status they reported and releases the lock."""
    ck = tmp_path / "ck"
    seen = {}

    def workers(cmd, save, per_node, handed_over, env_extra):
        seen["token"] = env_extra[INHERIT_ENV]
        seen["lock"] = json.loads((ck / LOCK_NAME).read_text())["token"]
        return 2  # a refusal the workers reported (worker_status)

    monkeypatch.setattr(launcher, "supervise", workers)
    assert launcher.launch(["--nproc-per-node", "2", *BASE, "--save", str(ck)]) == 2
    assert seen["token"] == seen["lock"]
    out = capsys.readouterr()
    assert out.out == "" and out.err == "" and not (ck / LOCK_NAME).exists()
