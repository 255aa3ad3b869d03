"""``--dry-run-device cuda``: the dry run builds and steps one rank on fake ``cuda:N`` tensors on
this CPU (:mod:`hybrid.dryrun.fake_cuda`), so a tensor created on the wrong device fails as it
would on a GPU, and the step's host<->device copies and host reads are listed with their source
lines. Needs a C++ compiler (the fake CUDA guard is a small extension); skipped, saying so,
without one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.config_fields import ConfigError
from hybrid.job.cli import parse_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3"]
CONFIGS = {
    "tp2xdp2 ZeRO-3 SP offload bf16": ["--tensor-model-parallel-size", "2", "--zero-stage", "3",
                                       "--sequence-parallel", "--recompute-granularity", "full",
                                       "--partition-activations", "--checkpoint-in-cpu", "--bf16",
                                       "--dry-run-world-size", "4"],
    "dp4 ZeRO-2 fp16 selective": ["--zero-stage", "2", "--fp16", "--recompute-granularity",
                                  "selective", "--dry-run-world-size", "4", "--dry-run-rank", "3"],
}
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="--dry-run-device cuda builds a C++ extension and no C++ compiler is installed")
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _run(argv: list[str], code: str = "") -> subprocess.CompletedProcess:
    program = ("import sys\nfrom hybrid.dryrun.fake_cuda import run_preloaded\n"
               "sys.exit(run_preloaded(sys.argv[2:], sys.argv[1]))")
    return subprocess.run([sys.executable, "-c", program, code, *argv], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=550)


def test_the_device_flag_is_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="--dry-run-device 'cuda'.*needs --dry-run-world-size"):
        parse_config(TINY + ["--dry-run-device", "cuda"])
    with pytest.raises(ConfigError, match="invalid choice: 'tpu' \\(choose from 'cpu', 'cuda'\\)"):
        parse_config(TINY + ["--dry-run-device", "tpu", "--dry-run-world-size", "2"])


@needs_compiler
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_rank_steps_on_fake_cuda_tensors(name):
    rank = 3 if "--dry-run-rank" in CONFIGS[name] else 0
    out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *TINY, *CONFIGS[name],
                          "--dry-run-device", "cuda"], capture_output=True, text=True, env=ENV,
                         cwd=ROOT, timeout=550)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # the step's only host reads: the mean loss and the grad norm; the batch is the only copy in
    assert f"one step on cuda:{rank % 8}:" in out.stdout and "2 host reads" in out.stdout
    assert "read 1 x host_values at hybrid/train_step.py" in out.stdout
    assert "cpu->cuda [2, 65] torch.int64 at hybrid/train_step.py" in out.stdout


@needs_compiler
@pytest.mark.timeout(600)
def test_a_tensor_on_the_wrong_device_fails_the_dry_run():
    planted = ("import torch, hybrid.zero.grad_norm as g\n"
               "def planted(tensors, device):\n"
               "    sq = torch.zeros((), dtype=torch.float64)  # the accumulator on the CPU\n"
               "    for t in tensors:\n"
               "        sq += torch.linalg.vector_norm(t, dtype=torch.float64) ** 2\n"
               "    return sq\n"
               "g._sum_of_squares = planted")
    argv = TINY + ["--zero-stage", "1", "--dry-run-world-size", "2", "--dry-run-device", "cuda"]
    out = _run(argv, planted)
    assert out.returncode != 0 and "wrong device, found cpu, expected cuda:0" in out.stderr, (
        out.stdout[-2000:] + out.stderr[-3000:])
    clean = _run(argv)
    assert clean.returncode == 0, clean.stderr[-3000:]


def test_a_cuda_build_of_torch_is_refused(monkeypatch):
    """A CUDA torch registers its own CUDA guard and hooks; faking them there would clash."""
    import torch

    from hybrid.dryrun import fake_cuda

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(RuntimeError, match="is built with CUDA 12.8: run the job on the GPU"):
        fake_cuda.library()


@needs_compiler
@pytest.mark.timeout(600)
def test_attention_dropout_is_measured_on_the_explicit_core_the_planner_counts():
    """On fake CUDA a CPU-only torch has no fused attention kernel with dropout: its math path
    keeps the whole fp32 score matrix (+47% over the planner here, where no GPU goes). The dry
    run measures the explicit core, the planner's upper bound, and names it."""
    argv = ["--mock-data", "--vocab-size", "512", "--num-layers", "8", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "512", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--bf16",
            "--zero-stage", "1", "--dry-run-world-size", "8", "--dry-run-device", "cuda"]
    out = _run(argv)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "attention core measured: explicit softmax core with dropout" in out.stdout
    total = re.search(r"total at the step peak +[\d.]+ +[\d.]+ +([-+\d.]+)%", out.stdout)
    assert total and abs(float(total.group(1))) <= 10, out.stdout[-3000:]


@needs_compiler
@pytest.mark.timeout(600)
def test_offloaded_optimizer_leaves_the_device_and_is_reported_on_the_host():
    """``--optimizer-cpu-offload`` at dp4 ZeRO-2 bf16: no fp32 master or Adam moment on the device;
    the host line holds 12 bytes (master + two moments) + 4 (the fp32 gradient copy) per
    partition element (136,960 local parameters / 4 = 34,240); the step copies each unit's
    reduced gradient to the host and the updated master back."""
    out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *TINY, "--zero-stage", "2",
                          "--bf16", "--optimizer-cpu-offload", "--dry-run-world-size", "4",
                          "--dry-run-device", "cuda"], capture_output=True, text=True, env=ENV,
                         cwd=ROOT, timeout=550)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(
        r"^(fp32 master|Adam moments|host optimizer \(not in total\)) +([\d.]+)", out.stdout,
        re.M)}
    assert rows["fp32 master"] == rows["Adam moments"] == 0.0, out.stdout[-3000:]
    assert rows["host optimizer (not in total)"] == pytest.approx(16 * 34_240 / 2**30, abs=1e-6)
    assert re.search(r"copy \d x cuda->cpu \[\d+\] torch.float32 at hybrid/zero/offload.py",
                     out.stdout)
    assert re.search(r"copy \d x cpu->cuda \[\d+\] torch.float32 at hybrid/zero/refresh.py",
                     out.stdout)
