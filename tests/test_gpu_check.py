"""``scripts/gpu_check.sh`` and ``scripts/gpu_multi_check.sh`` stay runnable: bash parses them,
shellcheck finds nothing, and the one-GPU check's CPU rehearsal (``GPU_CHECK_CPU=1``) runs its
dry steps to a clean summary here, and the whole rehearsal (every step at tiny shapes, each
step's limit x5 on CPU: 31 s on an idle 2-core machine, about 8 minutes on a loaded one) runs
to a clean summary in the slow test below."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "scripts" / "gpu_check.sh", ROOT / "scripts" / "gpu_multi_check.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_is_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    out = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(180)
def test_cpu_rehearsal_of_the_dry_steps(tmp_path):
    env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_STEPS="env tests attention",
               LOG_DIR=str(tmp_path), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(SCRIPTS[0])], env=env, capture_output=True, text=True,
                         timeout=170, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    log = (tmp_path / "gpu_check.log").read_text()
    for step in ("env", "tests", "attention"):
        assert f"  {step}: OK" in log, log[-3000:]
    assert "parity" not in log.split("=== summary")[1]  # only the steps asked for
    assert "explicit/fused time" in log and "missing packages: none" in log


def test_the_budget_stops_steps_that_would_overrun(tmp_path):
    env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_STEPS="env attention",
               GPU_CHECK_BUDGET_S="5", LOG_DIR=str(tmp_path), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(SCRIPTS[0])], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1
    assert "not run (the 5 s budget is spent)" in (tmp_path / "gpu_check.log").read_text()


STEPS = ("env", "tests", "parity", "recompute", "syncs", "pretrain", "attention")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_cpu_rehearsal_of_every_step(tmp_path):
    env = dict(os.environ, GPU_CHECK_CPU="1", LOG_DIR=str(tmp_path), PYTHON=sys.executable)
    env.pop("GPU_CHECK_STEPS", None)
    out = subprocess.run(["bash", str(SCRIPTS[0])], env=env, capture_output=True, text=True,
                         timeout=1550, cwd=ROOT)
    log = (tmp_path / "gpu_check.log").read_text()
    assert out.returncode == 0, log[-4000:] + out.stderr[-2000:]
    for step in STEPS:
        assert f"  {step}: OK" in log, log[-3000:]
    assert "pretrain (last log interval" in log and "predicted: dry run" in log
