"""The two ``.slurm`` scripts' ``DRY_RUN=1``: the dry run's verdict is on the GPU the script's
header plans for (the 405B script's dry run judged an A100-80GB, the default, while its header
plans H100s), named once."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, device", [("pretrain_llama3_405b_1024gpu.slurm", "H100"),
                                            ("pretrain_gpt_100b_400gpu.slurm", "V100-32GB")])
def test_the_dry_run_judges_the_gpu_the_header_plans(tmp_path, script, device):
    record = tmp_path / "args"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "DEVICE"}
    text = (ROOT / "scripts" / script).read_text()
    header = text.split("set -euo pipefail")[0]
    assert f"--device {device} " in header  # the planner command the header quotes
    for extra, want in (({}, device), ({"DEVICE": "H200"}, "H200")):
        subprocess.run(["bash", str(ROOT / "scripts" / script)], check=True, timeout=60,
                       env=dict(env, PYTHON=str(fake), DRY_RUN="1", **extra))
        args = record.read_text().split()
        assert args.count("--device") == 1 and args[args.index("--device") + 1] == want, args
