"""Issue 28 item 2: bf16/fp16 on a CPU without native 16-bit arithmetic warns once at start-up,
naming the missing CPU feature and the expected slowdown (4.7-7x, measured by a user)."""

import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.job.cpu_precision import cpu_features, slow_precision_message, warn_if_slow

ROOT = Path(__file__).resolve().parents[1]
X86_OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm {extra}\n"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return str(path)


def test_cpu_features_reads_x86_flags_and_arm_features(tmp_path):
    assert cpu_features(write(tmp_path, X86_OLD)) == (
        "x86", {"fpu", "sse2", "avx2", "avx512f", "avx512bw", "avx512_vnni"})
    assert cpu_features(write(tmp_path, ARM.format(extra="bf16"))) == (
        "arm", {"fp", "asimd", "evtstrm", "bf16"})
    assert cpu_features(str(tmp_path / "missing")) is None
    assert cpu_features(write(tmp_path, "model name: M2\n")) is None


@pytest.mark.parametrize(("precision", "text", "missing"), [
    ("bf16", X86_OLD, "avx512_bf16 / amx_bf16 in its flags"),
    ("fp16", X86_BF16, "avx512_fp16 / amx_fp16 in its flags"),
    ("bf16", ARM.format(extra="fphp"), "bf16 in its Features"),
    ("fp16", ARM.format(extra="bf16"), "fphp / asimdhp in its Features"),
])
def test_missing_feature_is_named_with_the_slowdown(precision, text, missing, tmp_path):
    message = slow_precision_message(precision, cpu_features(write(tmp_path, text)))
    assert message.startswith(f"--{precision} on a CPU without native {precision} arithmetic")
    assert f"(no {missing};" in message and "4.7-7x slower" in message
    assert f"drop --{precision}" in message


@pytest.mark.parametrize(("precision", "text"), [
    ("bf16", X86_BF16), ("bf16", "flags: amx_bf16\n"), ("fp16", "flags: avx512_fp16\n"),
    ("fp16", ARM.format(extra="asimdhp")), ("bf16", ARM.format(extra="bf16")),
    ("fp32", X86_OLD)])
def test_no_warning_where_the_cpu_has_it_or_in_fp32(precision, text, tmp_path):
    assert slow_precision_message(precision, cpu_features(write(tmp_path, text))) is None


def test_warns_only_on_cpu(tmp_path):
    path = write(tmp_path, X86_OLD)
    assert warn_if_slow("bf16", "cuda", path) is None
    with pytest.warns(UserWarning, match="4.7-7x"):
        assert warn_if_slow("bf16", "cpu", path)


def test_pretrain_warns_once_at_start_up():
    """A 2-iteration --bf16 run on a CPU made to look like one without avx512_bf16."""
    code = ("import sys\nfrom hybrid.job import cpu_precision\n"
            "cpu_precision.cpu_features = lambda path='': ('x86', {'avx2', 'avx512f'})\n"
            "from hybrid.pretrain import pretrain\nsys.exit(pretrain(sys.argv[1:]))\n")
    run = subprocess.run(
        [sys.executable, "-c", code, "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "2", "--vocab-size", "128", "--seq-length", "16",
         "--mock-data", "--bf16", "--train-iters", "2", "--micro-batch-size", "2",
         "--lr", "1e-3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in (run.stdout + run.stderr).splitlines() if "without native bf16" in x]
    assert len(lines) == 1, run.stdout + run.stderr
    assert lines[0].startswith("UserWarning: --bf16 on a CPU without native bf16 arithmetic (no "
                               "avx512_bf16 / amx_bf16 in its flags")
