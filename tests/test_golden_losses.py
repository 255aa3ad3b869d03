"""Pinned end-to-end numerics : the first 20 training losses of the CLI's
mock-data run at tp1 x dp1 ZeRO-0 and tp2 x dp2 ZeRO-3 (fp32, dropout 0.1), bit for bit.

The golden file was recorded before each restructure, so it proves that moving code changed no
arithmetic. CPU kernels differ between processors (MKL and ATen pick vector paths by CPU
feature), so the file holds one entry per machine kind (:func:`machine`): bit for bit on a
recorded kind; elsewhere within 1e-6 relative of every recorded kind (seen: 7e-8 after 20
steps across kinds; a changed dropout stream or schedule moves the losses by 1e-3 or more),
and the failure says how to record the new kind from a commit known to be right:
``python -m tests.test_golden_losses --record``. Re-record every kind only for a deliberate
numerical change.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs

GOLDEN = Path(__file__).with_name("golden_losses.json")
ARGV = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
        "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--seed", "11"]
GRIDS = {"tp1_dp1_zero0": (1, 1, 0), "tp2_dp2_zero3": (2, 2, 3)}


def grid_argv(tp: int, zero: int) -> list[str]:
    return ARGV + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(zero)]


def measure() -> dict[str, list[float]]:
    """Run both grids; return the 20 training losses of each (floats, as logged)."""
    out = {}
    for name, (tp, dp, zero) in GRIDS.items():
        (history,) = spawn_world(tp * dp, run_configs, [grid_argv(tp, zero)], timeout_s=120)[0]
        out[name] = [r["lm_loss"] for r in history
                     if r.get("kind", "train") == "train" and "split" not in r]
    return out


def machine() -> str:
    """The machine kind the CPU kernels depend on: torch version, ATen's vector ISA and a hash
    of the CPU's feature flags (``/proc/cpuinfo``; MKL dispatches on them)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        import platform
        flags = platform.processor()
    digest = hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]
    return f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} cpu {digest}"


@pytest.mark.timeout(300)
def test_losses_match_golden_file_bit_for_bit():
    golden = json.loads(GOLDEN.read_text())
    got = measure()
    here = machine()
    if here in golden:
        for name in GRIDS:
            assert len(golden[here][name]) == 20
            assert got[name] == golden[here][name], name  # exact: same arithmetic, same order
        return
    for kind, losses in golden.items():
        for name in GRIDS:
            assert all(math.isclose(a, b, rel_tol=1e-6)
                       for a, b in zip(got[name], losses[name], strict=True)), (
                f"{name}: losses differ from the {kind!r} record beyond a kernel difference; no "
                f"record for this machine ({here!r}): record it at a known-good commit with "
                "--record")


if __name__ == "__main__" and "--record" in sys.argv:
    records = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    records[machine()] = measure()
    GOLDEN.write_text(json.dumps(records, indent=1) + "\n")
    print(machine(), records[machine()])
