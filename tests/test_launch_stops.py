"""Stops that come while the launcher (:mod:`hybrid.job.launch`) starts the job, and a launcher
that dies: a stop before torchrun starts starts nothing, one before the workers catch it is
kept for them (honoured after the first iteration), and workers whose torchrun was SIGKILLed
stop as on SIGTERM (save, exit) instead of training on orphaned."""

import os
import signal
import time
from pathlib import Path

import pytest

from hybrid.checkpoint.directory import latest_iteration
from hybrid.job import launch as launcher
from hybrid.job import preemption
from hybrid.job.launch import children
from tests.test_launch import BASE, finish, launch, noise, wait_for_iterations


def test_a_stop_before_torchrun_starts_starts_nothing(monkeypatch, capsys):
    """The stop came while the launcher checked the flags: no torchrun, one line, exit 0."""
    monkeypatch.setattr(launcher, "supervise", lambda *a, **k: pytest.fail("torchrun started"))
    monkeypatch.setattr(preemption, "_EARLY", [(signal.SIGTERM, 0.0)])
    assert launcher.launch(["--nproc-per-node", "2", *BASE, "--train-iters", "5"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ("hybrid-pretrain: received SIGTERM before torchrun "
                                         "started: no process was started, nothing to save\n")


def test_the_entry_point_catches_a_stop_before_any_import_of_its_own():
    """``python -m hybrid.pretrain`` catches SIGTERM as soon as it has imported
    :mod:`hybrid.job.preemption`, which loads nothing the interpreter has not (``ctypes``, for
    the parent-death signal, only when asked): a SIGTERM in the launcher's first tens of ms
    exited 143 without a word while it loaded."""
    import subprocess
    import sys

    code = ("import sys; before = set(sys.modules); import hybrid.job.preemption; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.stdout.split() == ["hybrid", "hybrid.job", "hybrid.job.preemption", "signal"]


def test_a_stop_before_the_workers_catch_it_is_kept_for_them(monkeypatch):
    """torchrun starting (no worker), then workers that still ignore SIGTERM (inherited from
    torchrun): the stop waits; each worker gets it once, when its handler exists."""
    workers, caught, kills, catches = [[]], set(), [], launcher.catches
    monkeypatch.setattr(launcher, "children", lambda pid: list(workers[0]))
    monkeypatch.setattr(launcher, "catches", lambda pid, sig: pid in caught)
    monkeypatch.setattr(launcher, "_kill", lambda pids, sig: kills.append((list(pids), sig)))
    monkeypatch.setattr(launcher.os, "_exit", lambda code: pytest.fail(f"exit {code}"))
    forward = launcher._Forward(type("Proc", (), {"pid": 10})(), None, workers=2)
    forward(signal.SIGTERM, None)
    assert forward.waiting() and kills == []
    workers[0] = [11, 12]
    forward.deliver()
    assert forward.waiting() and kills == []
    caught.add(11)
    forward.deliver()
    forward(signal.SIGTERM, None)  # SLURM's second signal: the same stop
    caught.add(12)
    forward.deliver()
    forward.deliver()
    assert kills == [([11], signal.SIGTERM), ([12], signal.SIGTERM)] and not forward.waiting()
    # Python's own Ctrl-C handler, installed here: a background shell job starts pytest with
    # SIGINT ignored, and Python then installs none
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert catches(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not catches(os.getpid(), signal.SIGUSR2)


@pytest.mark.timeout(300)
def test_sigterm_while_torchrun_starts_is_honoured_after_the_first_iteration(tmp_path):
    """The process group (launcher, torchrun) is SIGTERMed as soon as torchrun exists, before
    any worker catches signals: the workers stop after iteration 1, save and exit 0."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "100", "--save", str(ck)], m, program="hybrid.pretrain")
    deadline = time.monotonic() + 100
    while not children(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    rc, lines = finish(proc)
    assert rc == 0 and latest_iteration(ck) == 1, lines[-30:]
    assert noise(lines) == [" exiting at iteration 1: received SIGTERM; saved checkpoint at "
                            f"iteration 1 to {ck}"], lines[-30:]


@pytest.mark.timeout(300)
def test_workers_stop_and_save_when_the_launcher_and_torchrun_are_killed(tmp_path):
    """``kill -KILL -<launcher's group>`` kills the launcher and torchrun; the workers (in
    sessions of their own) get SIGTERM from the kernel (PR_SET_PDEATHSIG), save and exit."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "10000", "--save", str(ck)], m, program="hybrid.pretrain")
    pids = wait_for_iterations(proc, m, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{p}").exists() for p in pids[2:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids[2:] if Path(f"/proc/{p}").exists()], "orphaned workers run on"
    rc, lines = finish(proc, timeout=30)
    stopped = latest_iteration(ck)
    assert rc == -signal.SIGKILL and stopped is not None and stopped >= 2, lines[-30:]
    assert noise(lines) == [f" exiting at iteration {stopped}: received SIGTERM; saved "
                            f"checkpoint at iteration {stopped} to {ck}"], lines[-30:]


@pytest.mark.timeout(300)
def test_a_launcher_killed_alone_takes_torchrun_and_the_workers_with_it(tmp_path):
    """``kill -9`` of the launcher process only (the OOM killer): within 10 s nothing of the
    job runs (the kernel SIGKILLs torchrun, whose workers save and exit), and the next launch
    with the same ``--save`` starts and continues from the stop's checkpoint."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "10000", "--save", str(ck)], m, program="hybrid.pretrain")
    pids = wait_for_iterations(proc, m, 2)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids[1:] if Path(f"/proc/{p}").exists()]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"torchrun {pids[1]} / workers {pids[2:]}: {alive} still alive after 10 s"
    stopped = latest_iteration(ck)
    assert stopped is not None and stopped >= 2
    again = launch(["--train-iters", str(stopped + 1), "--save", str(ck), "--load", str(ck)],
                   tmp_path / "again.jsonl", program="hybrid.pretrain")
    rc, lines = finish(again)
    assert rc == 0 and latest_iteration(ck) == stopped + 1, lines[-30:]


@pytest.mark.timeout(120)
def test_a_locked_save_is_refused_by_the_launcher_in_one_line(tmp_path):
    """A live job (this test's process) holds ``--save``'s lock: the launcher refuses before
    torchrun starts, one line and exit status 2 as every refusal before start (not torchrun's
    ChildFailedError report), and so does a job without the launcher (its rank 0); a stale
    lock (its pid gone) does not stop it there."""
    import json
    import socket
    import subprocess
    import sys

    from hybrid.checkpoint.lock import LOCK_NAME, in_use, pid_start_ticks, this_job

    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen(["sleep", "100"])  # a live job on this host
    (ck / LOCK_NAME).write_text(json.dumps(dict(this_job(), pid=holder.pid,
                                                pid_start=pid_start_ticks(holder.pid))))
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", "--nproc-per-node", "2",
                              *BASE, "--train-iters", "2", "--save", str(ck)],
                             capture_output=True, text=True, timeout=100, env=env)
        lines = (out.stdout + out.stderr).splitlines()
        assert out.returncode == 2 and len(lines) == 1, lines[-40:]
        assert lines[0].startswith(f"hybrid-pretrain: error: --save {ck} is in use by another "
                                   f"job: host {socket.gethostname()}, pid {holder.pid}, ")
        assert in_use(ck).split(" (its lock")[0] == lines[0][24:].split(" (its lock")[0]
        alone = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *BASE, "--train-iters",
                                "2", "--save", str(ck)], capture_output=True, text=True,
                               timeout=100, env=env)
        assert alone.returncode == 2, alone.stderr[-3000:]
        assert lines[0].split(" (its lock")[0] in alone.stderr, alone.stderr[-3000:]
    finally:
        holder.kill()
        holder.wait()
    assert in_use(ck) is None  # its pid is gone: a stale lock, taken over by rank 0


@pytest.mark.timeout(300)
def test_two_jobs_started_at_once_on_one_save_one_is_refused_by_its_launcher(tmp_path):
    """Two launchers started at the same moment with one ``--save``: both started torchrun and
    one was refused inside its ranks (exit status 1 and torchrun's ChildFailedError report).
    Now the launcher takes the lock before torchrun starts (and hands it to its rank 0): the
    other is refused there, one line, exit status 2; the first trains and saves."""
    import socket

    from hybrid.checkpoint.lock import LOCK_NAME

    ck = tmp_path / "ck"
    jobs = [launch(["--train-iters", "3", "--save", str(ck)], tmp_path / f"{i}.jsonl",
                   program="hybrid.pretrain") for i in range(2)]
    done = [finish(job) for job in jobs]
    (won, refused) = sorted(range(2), key=lambda i: done[i][0])
    assert [done[won][0], done[refused][0]] == [0, 2], [d[1][-20:] for d in done]
    lines = done[refused][1]
    assert len(lines) == 1 and lines[0].startswith(
        f"hybrid-pretrain: error: --save {ck} is in use by another job: host "
        f"{socket.gethostname()}, pid {jobs[won].pid}, "), lines
    assert latest_iteration(ck) == 3 and not (ck / LOCK_NAME).exists()
    assert not list(ck.glob(f"{LOCK_NAME}.*"))  # no temporary record left beside it


@pytest.mark.timeout(300)
def test_workers_killed_during_start_up_with_their_torchrun_leave_nothing_running(tmp_path):
    """``kill -KILL -<launcher's group>`` while the workers start (nothing to save yet, maybe
    blocked in the rendezvous with torchrun's store, where no Python handler runs): the kernel
    SIGKILLs them too (PR_SET_PDEATHSIG), instead of leaving them to wait out the rendezvous
    timeout (10 minutes) as orphans."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "100", "--save", str(ck)], m, program="hybrid.pretrain")
    deadline = time.monotonic() + 100
    while not [w for t in children(proc.pid) for w in children(t)]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    workers = [w for t in children(proc.pid) for w in children(t)]
    time.sleep(0.5)  # the workers are importing or in the rendezvous
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in workers if Path(f"/proc/{p}").exists()]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "workers run on after their torchrun was killed during start-up"
    finish(proc, timeout=30)
