"""One job per save directory (issue 27, kind 6): a second job is refused before training,
naming the first; a dead job's lock (this host: pid gone, zombie or reused; another host: not
refreshed) is taken over with a note."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import hybrid.checkpoint.lock as lock_module
from hybrid.checkpoint.lock import LOCK_NAME, SaveDirectoryInUseError, SaveLock, pid_start_ticks
from hybrid.parallel.spawn import spawn_world
from tests.save_worlds import MOCK, second_job


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def hold(root, pid, host=None, pid_start=None, age_s=0.0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    record = dict(host=host or socket.gethostname(), pid=pid, started="2026-01-02 03:04:05 UTC",
                  pid_start=pid_start if pid_start is not None else pid_start_ticks(pid),
                  job_id="4242", token="theirs")
    (root / LOCK_NAME).write_text(json.dumps(record))
    t = time.time() - age_s
    os.utime(root / LOCK_NAME, (t, t))


def test_live_job_on_this_host_refuses_then_its_death_frees_the_directory(tmp_path):
    p = sleeper()
    try:
        hold(tmp_path, p.pid)
        with pytest.raises(SaveDirectoryInUseError) as e:
            SaveLock(tmp_path)
        msg = str(e.value)
        for part in (f"host {socket.gethostname()}", f"pid {p.pid}",
                     "started 2026-01-02 03:04:05 UTC", "job 4242", str(tmp_path / LOCK_NAME)):
            assert part in msg, (part, msg)
    finally:
        p.kill()
        p.wait()
    lock = SaveLock(tmp_path)
    assert f"pid {p.pid} no longer runs on this host" in lock.note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_reused_pid_and_other_hosts(tmp_path):
    hold(tmp_path, os.getppid(), pid_start=1)  # alive, but started at another time
    lock = SaveLock(tmp_path)
    assert "belongs to another process" in lock.note
    lock.release()
    hold(tmp_path, 1, host="node-elsewhere", age_s=30)
    with pytest.raises(SaveDirectoryInUseError, match="host node-elsewhere, pid 1"):
        SaveLock(tmp_path)
    hold(tmp_path, 1, host="node-elsewhere", age_s=lock_module.STALE_AFTER_S + 5)
    lock = SaveLock(tmp_path)
    assert "last refreshed" in lock.note and "node-elsewhere" in lock.note
    lock.release()


def test_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    lock = SaveLock(tmp_path)
    old = time.time() - 100
    os.utime(tmp_path / LOCK_NAME, (old, old))
    time.sleep(0.5)
    assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 5
    lock.release()


@pytest.mark.timeout(300)
def test_second_job_is_refused_on_every_rank_before_training(tmp_path):
    ck = tmp_path / "ck"
    p = sleeper()
    try:
        hold(ck, p.pid)
        got = spawn_world(2, second_job, MOCK + ["--train-iters", "2", "--save", str(ck)], p.pid,
                          timeout_s=60)
    finally:
        p.kill()
        p.wait()
    for refused, listing, trained in got:
        assert listing == LOCK_NAME  # refused before training: nothing saved
        assert refused.startswith(f"--save {ck} is in use by another job: host "), refused
        assert f"pid {p.pid}, started 2026-01-02 03:04:05 UTC" in refused
        assert trained == "2"  # after the holder died: taken over, trained and saved
    assert not (ck / LOCK_NAME).exists() and (ck / "iter_0000002").is_dir()
