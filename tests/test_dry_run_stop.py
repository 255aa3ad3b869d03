"""A dry run stops at the next phase boundary on SIGTERM or Ctrl-C, with one line and exit
status 0, as training does (issue 37 item 6: a 405B rank's dry run ignored both, without a
word, until its step ended: 123 s and 60 s)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--mock-data", "--vocab-size", "512", "--micro-batch-size", "1",
         "--global-batch-size", "400", "--dry-run-world-size", "2",
         "--dry-run-micro-batches", "400"]  # 801 phases: minutes, unless the stop is honoured


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_ends_the_dry_run_at_the_next_phase_with_one_line(sig):
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.pretrain", *FLAGS], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("dry run phase: build"):
            proc.send_signal(sig)
            sent = time.monotonic()
            break
    rest, _ = proc.communicate(timeout=200)
    lines += rest.splitlines()
    assert proc.returncode == 0, lines[-20:]
    assert time.monotonic() - sent < 60, "the stop waited for the step"
    phases = [x for x in lines if x.startswith("dry run phase: ")]
    assert len(phases) <= 4, phases  # build, then at most the phase running when it came
    (stop,) = [x for x in lines if x.startswith("dry run stopped")]
    assert stop.startswith("dry run stopped after phase ") and stop.endswith(
        f": received {sig.name}; no report (the step did not finish)"), stop
    assert lines[-1] == stop and not [x for x in lines if "verdict" in x]
