"""Pinned end-to-end numerics : the first 20 training losses of the CLI's
mock-data run at tp1 x dp1 ZeRO-0 and tp2 x dp2 ZeRO-3 (fp32, dropout 0.1), bit for bit.

The golden file was recorded before the subpackage restructure, so it proves that moving code
changed no arithmetic. Re-record only for a deliberate numerical change:
``python -m tests.test_golden_losses --record``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs

GOLDEN = Path(__file__).with_name("golden_losses.json")
ARGV = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--seed", "11"]
GRIDS = {"tp1_dp1_zero0": (1, 1, 0), "tp2_dp2_zero3": (2, 2, 3)}


def grid_argv(tp: int, zero: int) -> list[str]:
    return ARGV + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(zero)]


def measure() -> dict[str, list[float]]:
    """Run both grids; return the 20 training losses of each (floats, as logged)."""
    out = {}
    for name, (tp, dp, zero) in GRIDS.items():
        (history,) = spawn_world(tp * dp, run_configs, [grid_argv(tp, zero)], timeout_s=120)[0]
        out[name] = [r["lm_loss"] for r in history if r.get("kind", "train") == "train" and "split" not in r]
    return out


@pytest.mark.timeout(300)
def test_losses_match_golden_file_bit_for_bit():
    golden = json.loads(GOLDEN.read_text())
    got = measure()
    for name in GRIDS:
        assert len(golden[name]) == 20
        assert got[name] == golden[name], name  # exact: same arithmetic, same order


if __name__ == "__main__" and "--record" in sys.argv:
    GOLDEN.write_text(json.dumps(measure(), indent=1) + "\n")
    print(GOLDEN.read_text())
