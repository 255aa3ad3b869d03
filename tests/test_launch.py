"""The launcher ``hybrid-pretrain --nproc-per-node N`` (:mod:`hybrid.job.launch`): stops by
signal under torchrun (issue 27 kind 1, issue 28 item 4) and one-line configuration errors.

Each job is a real torchrun of 2 CPU ranks (gloo) started through the launcher, so these tests
are few and each one checks many things. The workers run ``tests.slow_save_launch``, which is
``hybrid.pretrain`` with a slowed checkpoint save.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.checkpoint.directory import latest_iteration
from hybrid.job.launch import children

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--mock-data", "--vocab-size", "500", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr-decay-style", "constant", "--eval-iters", "0",
        "--log-interval", "1", "--seed", "3", "--distributed-timeout-minutes", "1"]
FULL = 60  # iterations of the uninterrupted reference run


def launch(extra, metrics, slow_save_s=0.0, program="tests.slow_save_launch"):
    """Start the launcher (2 ranks) in a session of its own, as a terminal or a job step would:
    its process group is the launcher and torchrun (torchrun's workers have sessions of their
    own). ``program``: ``hybrid.pretrain`` itself, or the same with slow saves."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               SLOW_SAVE_S=str(slow_save_s), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3")
    return subprocess.Popen(
        [sys.executable, "-m", program, "--nproc-per-node", "2", *BASE,
         "--metrics-file", str(metrics), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True)


def losses(metrics: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"]
            for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"}


def wait_for_iterations(proc, metrics: Path, n: int) -> list[int]:
    """Wait until ``n`` iterations are logged; returns ``[launcher, torchrun, workers...]``."""
    deadline = time.monotonic() + 150
    while not metrics.exists() or metrics.read_text().count('"train"') < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    (torchrun,) = children(proc.pid)
    workers = children(torchrun)
    assert len(workers) == 2, workers
    return [proc.pid, torchrun, *workers]


def finish(proc, timeout=150) -> tuple[int, list[str]]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.splitlines()


def noise(lines):
    """Lines that are neither the log nor start-up lines: what a stop added."""
    return [x for x in lines if not x.startswith((" iteration", "hybrid-zero", "ZeRO stage",
                                                   "hybrid-pretrain: kernel fusion: ",
                                                   "hybrid-pretrain: note: ZeRO-1, the default"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses (the same seed and data, constant learning rate)."""
    m = tmp_path_factory.mktemp("reference") / "m.jsonl"
    rc, lines = finish(launch(["--train-iters", str(FULL)], m))
    assert rc == 0, lines[-30:]
    return losses(m)


def resume_matches(ck: Path, stopped: int, tmp: Path, reference: dict) -> None:
    """A job resumed from ``ck`` continues at ``stopped + 1`` with the reference's losses."""
    assert stopped + 2 <= FULL
    m = tmp / "resumed.jsonl"
    rc, lines = finish(launch(["--train-iters", str(stopped + 2), "--load", str(ck)], m))
    assert rc == 0, lines[-30:]
    resumed = losses(m)
    assert sorted(resumed) == [stopped + 1, stopped + 2]
    assert all(resumed[i] == reference[i] for i in resumed), (resumed, reference)  # bitwise


@pytest.mark.timeout(600)
def test_sigterm_to_every_process_saves_past_torchrun_timeout_and_exits_0(tmp_path, reference):
    """SLURM's stop signals every process of the step (launcher, torchrun, workers) at once.
    The save takes 8 s, past torchrun's shutdown timeout (3 s here, 30 s by default, after
    which a torchrun that handled the SIGTERM itself SIGKILLs the workers and exits 1)."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "10000", "--save", str(ck)], m, slow_save_s=8)
    pids = wait_for_iterations(proc, m, 3)
    t0 = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    rc, lines = finish(proc)
    assert rc == 0, lines[-30:]
    assert time.monotonic() - t0 > 8  # the save outlasted torchrun's timeout
    stopped = latest_iteration(ck)
    assert stopped is not None and stopped >= 3
    assert noise(lines) == [f" exiting at iteration {stopped}: received SIGTERM; saved "
                            f"checkpoint at iteration {stopped} to {ck}"], lines[-30:]
    resume_matches(ck, stopped, tmp_path, reference)


@pytest.mark.timeout(600)
def test_ctrl_c_saves_with_one_line_and_the_job_resumes_exactly(tmp_path, reference):
    """Ctrl-C at the terminal (SIGINT to the foreground process group: the documented launcher
    ``python -m hybrid.pretrain --nproc-per-node 2`` and torchrun) stops like SIGTERM; the same
    Ctrl-C delivered twice 50 ms apart is one stop (the launcher's 1 s debounce)."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "10000", "--save", str(ck)], m, program="hybrid.pretrain")
    wait_for_iterations(proc, m, 3)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    rc, lines = finish(proc)
    assert rc == 0, lines[-30:]
    stopped = latest_iteration(ck)
    assert stopped is not None and stopped >= 3
    assert noise(lines) == [f" exiting at iteration {stopped}: received SIGINT; saved "
                            f"checkpoint at iteration {stopped} to {ck}"], lines[-30:]
    resume_matches(ck, stopped, tmp_path, reference)


@pytest.mark.timeout(300)
def test_second_ctrl_c_ends_every_process_at_once_with_one_line(tmp_path):
    """The second Ctrl-C lands during a 60 s save: every process ends now, nothing is
    published, one line, exit status 130."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = launch(["--train-iters", "10000", "--save", str(ck)], m, slow_save_s=60)
    pids = wait_for_iterations(proc, m, 3)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(3)  # the stop is agreed after one iteration (~0.1 s); the save now sleeps
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    rc, lines = finish(proc, timeout=30)
    assert rc == 130 and time.monotonic() - t0 < 10, (rc, lines[-30:])
    assert noise(lines) == ["hybrid-pretrain: second interrupt: ended every process now, without "
                            f"saving: {ck} holds no checkpoint"], lines[-30:]
    assert latest_iteration(ck) is None
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids[1:] if Path(f"/proc/{p}").exists()]


@pytest.mark.timeout(120)
def test_a_bad_flag_under_the_launcher_is_one_line_before_any_rank_starts():
    """Issue 28 item 3: at most 3 lines and a non-zero exit, with --nproc-per-node 4 through
    the documented launcher and through scripts/pretrain_gpt.sh (no worker starts: torchrun's
    ~45 lines of ChildFailedError never come)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPUS_PER_NODE="4", MASTER_PORT="1",
               PYTHON=sys.executable)  # the script would take .venv/bin/python, else python3
    model = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4"]
    cases = [
        ([sys.executable, "-m", "hybrid.pretrain", "--nproc-per-node", "4", *model,
          "--zero-stage", "7"], "--zero-stage 7 (ZeroConfig.stage): valid values are 0, 1, 2, 3"),
        (["bash", "scripts/pretrain_gpt.sh", *model, "--tensor-model-parallel-size", "3"],
         "tensor-model-parallel size 3 does not divide the world size 4"),
        ([sys.executable, "-m", "hybrid.pretrain", "--nproc_per_node=4", "--nnodes", "two",
          *model], "--nproc-per-node 4 --nnodes two: give positive numbers"),
    ]
    for cmd, message in cases:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
        lines = (out.stdout + out.stderr).splitlines()
        assert out.returncode == 2 and len(lines) <= 3, (cmd, lines[-40:])
        assert lines[0].startswith("hybrid-pretrain: error: ") and message in lines[0], lines


def test_a_second_interrupt_exits_at_once_and_a_repeated_one_does_not():
    """Without the launcher (``python -m hybrid.pretrain``, torchrun alone): a stop during
    start-up is kept; the same Ctrl-C delivered twice (srun, torchrun) is one; a second one
    later ends the process with one line and status 130."""
    code = "\n".join([
        "import os, signal, time",
        "from hybrid.job.preemption import StopSignal, catch_stops_early",
        "catch_stops_early()",
        "os.kill(os.getpid(), signal.SIGINT)",
        "stop = StopSignal()",
        "assert stop.received == signal.SIGINT and stop.requested()",
        "os.kill(os.getpid(), signal.SIGINT)",
        "print('kept', flush=True)",
        "time.sleep(1.5)",
        "os.kill(os.getpid(), signal.SIGINT)",
        "time.sleep(5)",
        "print('not reached')",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 130 and out.stdout == "kept\n", (out.stdout, out.stderr)
    assert out.stderr == ("hybrid-pretrain: second interrupt: exiting now; a save in progress is "
                          "abandoned, every completed checkpoint stays\n")


def test_the_launchers_second_interrupt_is_debounced_and_says_which_checkpoint_stays(
        tmp_path, monkeypatch):
    """The launcher's handler alone (no torchrun): a repeat within 1 s is the same Ctrl-C; a
    second one later ends everything with a line true to what the save directory holds; once
    the workers have ended, a Ctrl-C changes nothing."""
    from hybrid.checkpoint.directory import POINTER
    from hybrid.job import launch as launcher

    now, workers, kills = [0.0], [[11, 12]], []
    monkeypatch.setattr(launcher, "children", lambda pid: list(workers[0]))
    monkeypatch.setattr(launcher, "catches", lambda pid, sig: True)  # handlers installed
    monkeypatch.setattr(launcher, "_kill", lambda pids, sig: kills.append((list(pids), sig)))
    monkeypatch.setattr(launcher.os, "_exit", lambda code: (_ for _ in ()).throw(
        SystemExit(code)))
    proc = type("Proc", (), {"pid": 10})()

    def handler(save):
        now[0] = 0.0
        kills.clear()
        return launcher._Forward(proc, None if save is None else str(save), lambda: now[0])

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / POINTER).write_text("5")
    forward = handler(ck)
    forward(signal.SIGINT, None)
    now[0] = 0.05
    forward(signal.SIGINT, None)  # the same Ctrl-C: nothing more
    assert kills == [([11, 12], signal.SIGINT)]
    (ck / POINTER).write_text("409")  # the stop's save completes, a worker still closing
    now[0] = 2.0
    with pytest.raises(SystemExit, match="130"):
        forward(signal.SIGINT, None)
    assert kills[-1] == ([10, 11, 12], signal.SIGKILL)
    lines = {
        "saved": launcher.ended_line("second interrupt", str(ck), 5),
        "kept": launcher.ended_line("second interrupt", str(ck), 409),
        "none": launcher.ended_line("second interrupt", str(tmp_path / "empty"), None),
        "no --save": launcher.ended_line("second interrupt", None, None)}
    head = "hybrid-pretrain: second interrupt: ended every process now"
    assert lines == {
        "saved": f"{head}, after the stop's save had completed: the checkpoint at iteration 409 "
                 f"in {ck} stays",
        "kept": f"{head}, without saving: the last saved checkpoint stays (iteration 409 in {ck})",
        "none": f"{head}, without saving: {tmp_path / 'empty'} holds no checkpoint",
        "no --save": f"{head}; nothing was saved (no --save)"}
    forward = handler(None)
    forward(signal.SIGINT, None)
    workers[0] = []  # the workers saved and exited; torchrun is ending by itself
    now[0] = 3.0
    forward(signal.SIGINT, None)
    assert kills == [([11, 12], signal.SIGINT)]


def test_a_reported_failure_goes_to_the_launcher_unless_torchrun_restarts(tmp_path, monkeypatch):
    """A failure the job reported in one line (a full disk, NaNs, a taken --save) ended with
    torchrun's ChildFailedError report and torchrun's status 1 (2 for a taken --save): the
    workers now hand the status to the launcher and exit 0. With --max-restarts torchrun must
    see the failure to restart, so the workers exit with it."""
    from hybrid.job import launch as launcher

    status_file = tmp_path / "status"
    status_file.write_text("")
    monkeypatch.delenv(launcher.STATUS_FILE_ENV, raising=False)
    assert launcher.worker_status(1) == 1  # plain torchrun: the status itself
    monkeypatch.setenv(launcher.STATUS_FILE_ENV, str(tmp_path / "no" / "such"))
    assert launcher.worker_status(1) == 1  # the file cannot be written: the status itself
    monkeypatch.setenv(launcher.STATUS_FILE_ENV, str(status_file))
    assert [launcher.worker_status(s) for s in (0, 2, 1)] == [0, 0, 0]
    assert launcher._reported(str(status_file)) == 2 and not status_file.exists()

    seen = []
    monkeypatch.setattr(launcher, "supervise", lambda *a, **k: seen.append(k) or 0)
    for restarts in ([], ["--max-restarts", "0"], ["--max_restarts", "3"]):
        launcher.launch(["--nproc-per-node", "2", *restarts, *BASE])
    assert [k["handed_over"] for k in seen] == [True, True, False]
