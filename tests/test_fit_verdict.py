"""Issue 28 item 1: "does it fit" in one unit (GiB) from the planner and the dry run.

The planner's table and the dry run's report are in GiB and say so in their headers; device
capacities are the GiB each GPU reports; the dry run takes the planner's ``--device`` /
``--gpu-memory-gib`` / ``--reserved-gib`` and ends with a verdict by the planner's rule (step
peak + reserve <= memory); it runs one micro-batch unless ``--dry-run-micro-batches N`` and
prints one line per phase with its time. The two dry runs are subprocesses of
``python -m hybrid.pretrain`` (the fake process group is the default group).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.devices import GIB, fit_verdict
from hybrid.planner import cli as plan_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--vocab-size", "1024", "--seq-length", "64", "--mock-data", "--bf16",
         "--tensor-model-parallel-size", "2", "--zero-stage", "2", "--global-batch-size", "32",
         "--dry-run-world-size", "8"]


def test_fit_verdict_is_the_planners_rule():
    assert fit_verdict(70 * GIB, 80.0, 1.0) == (
        True, "fits: 70.00 GiB step peak + 1 GiB reserve = 71.00 GiB of the GPU's 80.00 GiB "
              "(9.00 GiB to spare)")
    assert fit_verdict(79 * GIB, 80.0, 1.0)[0]          # exactly full fits, as in the planner
    fits, text = fit_verdict(79.5 * GIB, 80.0, 1.0)
    assert not fits and text.endswith("(0.50 GiB over)") and text.startswith("does NOT fit")


def test_planner_table_is_in_gib_and_takes_pretrains_flag_names(capsys):
    args = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--num-gpus", "8", "--device", "H100"]
    assert plan_cli.main([*args, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "x H100: 79.65 GiB, peak 989 TFLOP/s" in out
    assert "per-rank GiB (2^30 B)" in out and re.search(r"best: .* GiB/rank", out)
    assert " GB" not in out.replace("GB/s", "")
    # hybrid.pretrain's names for the model and tp give the same plan
    assert plan_cli.main(["--preset", "gpt2-355m", "--num-gpus", "8", "--device", "H100",
                          "--tensor-model-parallel-size", "2"]) == 0
    by_pretrain = capsys.readouterr().out
    assert plan_cli.main(["--model", "gpt2-355m", "--num-gpus", "8", "--device", "H100",
                          "--tp", "2"]) == 0
    assert capsys.readouterr().out == by_pretrain
    # --max-model's header names its budget in GiB: the device less the reserve
    assert plan_cli.main(["--max-model", "--device", "V100-32GB", "--tp", "1"]) == 0
    assert capsys.readouterr().out.startswith("largest model per GPU budget of 30.75 GiB")


def dry(*extra: str) -> str:
    run = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *SMALL, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.timeout(600)
def test_dry_run_phases_and_verdict():
    out = dry("--gpu-memory-gib", "0.1", "--reserved-gib", "0.099")
    lines = out.splitlines()
    assert lines[0].endswith("| memory in GiB (2^30 bytes)")
    assert lines[1].startswith("dry run: the step runs 1 of the job's 8 micro-batch(es) per rank")
    phases = [re.match(r"dry run phase: (\w+).* ([\d.]+) s$", x) for x in lines
              if x.startswith("dry run phase:")]
    assert [p.group(1) for p in phases] == ["build", "forward", "backward", "step", "save"]
    assert "GiB (2^30 bytes) per rank" in out
    total = float(next(x for x in lines if x.startswith("total at the step peak")).split()[-3])
    assert all(float(p.group(2)) >= 0 for p in phases)
    verdict = next(x for x in lines if x.startswith("verdict on 0.1 GiB GPU"))
    # a step peak of a few MiB does not fit in the 1 MiB the reserve leaves
    assert 0.002 < total < 0.05, total
    assert (f"does NOT fit: {total:.4f} GiB step peak + 0.099 GiB reserve = {total + 0.099:.4f}"
            f" GiB of the GPU's 0.1000 GiB ({total - 0.001:.4f} GiB over)") in verdict
    assert "planner (agrees): does NOT fit" in out

    out = dry("--dry-run-micro-batches", "2", "--device", "H100")
    assert "the step runs 2 of the job's 8 micro-batch(es)" in out
    assert [x.split(" (")[0] for x in out.splitlines() if x.startswith("dry run phase:")] == [
        "dry run phase: build", "dry run phase: forward", "dry run phase: backward",
        "dry run phase: forward", "dry run phase: backward", "dry run phase: step",
        "dry run phase: save"]
    assert re.search(r"verdict on H100 .* fits: .* of the GPU's 79\.65 GiB", out)


@pytest.mark.parametrize(("extra", "message"), [
    (["--device", "B200"], "--device 'B200' is no preset (V100-32GB, A100-40GB, A100-80GB, "
                           "H100, H200); give --gpu-memory-gib"),
    (["--dry-run-micro-batches", "0"], "--dry-run-micro-batches 0"),
    (["--device", "V100-32GB", "--reserved-gib", "40"],
     "--reserved-gib 40 leaves nothing of the GPU's 31.75 GiB"),
])
def test_dry_run_device_flags_are_checked_first(extra, message):
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config([*SMALL, *extra])


def test_verdict_and_verify_lines_round_sizes_given_in_gb():
    """GB flags convert to unrounded GiB: ``verdict on 27.9397 GiB GPU``, ``1.86265 GiB
    reserve`` were printed as they came."""
    from hybrid.dryrun.report import verdict_lines
    from hybrid.dryrun.verify import comparison_lines

    memory, reserve = 30e9 / GIB, 2e9 / GIB
    r = dict(measured=dict(total=20 * GIB), planned=dict(total=21 * GIB), rank=0,
             device="cuda:0")
    text = "\n".join(verdict_lines(r, None, memory, reserve))
    assert "verdict on 27.94 GiB GPU" in text and "+ 1.86 GiB reserve = 21.86 GiB" in text, text
    result = dict(reserved_gib=reserve, measured_total=20 * GIB, memory_gib=memory, fits=True,
                  attention="explicit")
    line = comparison_lines(result, 22 * GIB, True)[0]
    assert line.startswith("verify (rank 0, GiB, reserve 1.86 included): planner 22.00"), line
    assert not re.search(r"\d\.\d{3}", text + line)
    assert fit_verdict(GIB / 100, 0.05, 0.005)[1].startswith("fits: 0.0100 GiB step peak + 0.005")
