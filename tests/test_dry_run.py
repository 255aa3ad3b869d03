"""The dry run (issue 12 item 5) and the planner's buffer term (item 6), at world 64.

``hybrid.pretrain --dry-run-world-size 64`` builds rank 37 (tp 2 x dp 32) with the fake
process group and fake tensors through the real ``parallelize`` and ``train_step``; each
configuration runs in its own process (the fake group is the default group). Checks: the step
completed (one optimizer step, not skipped); the bytes torch's MemTracker saw allocated once
the engine was built equal the engine's model states + buffers (to 64 KiB: AdamW's 0-d step
tensors); the construction peak is within one unit in fp32 (+ the weight source's two
one-parameter temporaries + 1 MiB) of that; the model states equal the planner's within 1%
(the layout pads each unit to dp * 8 elements); and the planner's buffers equal what the
engine allocated: exactly at stage 2, within 1% at stage 3 (gathered units, padded).
"""

import json
import subprocess
import sys

import pytest

MIB = 2**20
FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--vocab-size", "4096", "--seq-length", "64", "--mock-data", "--bf16",
         "--tensor-model-parallel-size", "2", "--reduce-bucket-size", "640000",
         "--allgather-bucket-size", "640000", "--param-persistence-threshold", "0",
         "--checkpoint-activations", "--dry-run-world-size", "64", "--dry-run-rank", "37"]
CODE = """
import json, sys
from hybrid.cli import parse_config
from hybrid.config_checks import validate
from hybrid.dry_run import dry_run
cfg = parse_config(sys.argv[1:])
print("RESULT " + json.dumps(dry_run(cfg, validate(cfg, world_size=64), 37)))
"""


def run(stage: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, *FLAGS, "--zero-stage", str(stage)],
                         capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_dry_run_world_64(stage):
    r = run(stage)
    m, p = r["measured"], r["planned"]
    assert (r["tp"], r["dp"], r["tp_rank"], r["dp_rank"]) == (2, 32, 1, 18)
    assert r["optimizer_steps"] == 1
    held = m["states"] + m["buffers"] - m["gathered_peak"]
    assert 0 <= m["tracked_after_build"] - held <= 64 * 1024, (m["tracked_after_build"], held)
    unit = r["bound"] - m["tracked_after_build"]
    assert m["construction_peak"] <= m["tracked_after_build"] + unit + 8 * r["largest_param"] + MIB
    for k in ("params", "grads", "master", "optimizer", "states"):
        assert abs(m[k] - p[k]) <= 0.01 * p[k], (k, m[k], p[k])
    if stage == 2:
        assert m["buffers"] == p["buffers"]
    else:
        assert m["gathered_peak"] > 0 and abs(m["buffers"] - p["buffers"]) <= 0.01 * p["buffers"]
