"""The planner's command line: text, JSON, the max-model question, bad input, ``python -m``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid import flops
from hybrid.planner import cli as plan_cli
from hybrid.planner import max_model
from tests.test_flops import gpt

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]

# CLI -----------------------------------------------------------------------------------------

DIMS = [
    "--num-layers",
    "48",
    "--hidden-size",
    "1600",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "1024",
    "--micro-batch-size",
    "4",
    "--num-gpus",
    "8",
]


def test_cli_text(capsys):
    assert plan_cli.main(DIMS) == 0
    out = capsys.readouterr().out
    assert "best: tp=" in out and "MFU" in out


def test_cli_json(capsys):
    assert plan_cli.main([*DIMS, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_parameters"] == flops.num_parameters(gpt(48, 1600, 16, v=50257, s=1024))
    assert len(doc["candidates"]) == 4 * 4 * 4 - 4  # no full+pa at tp=1
    assert doc["best"]["fits"] is True
    assert set(doc["best"]["model_states"]) == {"params", "grads", "master", "optimizer", "total"}


def test_cli_max_model(capsys):
    args = [
        "--max-model",
        "--num-gpus",
        "64",
        "--gpus-per-node",
        "8",
        "--gpu-memory-gb",
        "32",
        "--reserved-gb",
        "0",
        "--tp",
        "1",
        "--json",
    ]
    assert plan_cli.main(args) == 0
    rows = json.loads(capsys.readouterr().out)["max_model"]
    assert [r["max_params_model_states"] for r in rows] == [
        max_model.max_params(32 * GB, 1, 64, s) for s in range(4)
    ]
    assert plan_cli.main([*DIMS, "--max-model", "--tp", "8", "--zero-stage", "3"]) == 0
    assert "layers" in capsys.readouterr().out
    width_only = ["--max-model", "--hidden-size", "1600", "--num-attention-heads", "16", "--json"]
    assert plan_cli.main(width_only) == 0
    rows = json.loads(capsys.readouterr().out)["max_model"]
    assert all(r["max_layers"]["full"] >= r["max_layers"]["none"] for r in rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "tp=3 must divide num_attention_heads=16"),
        (["--num-gpus", "12"], "num_gpus=12 is not divisible by gpus_per_node=8"),
        (["--hidden-size", "-5"], "--hidden-size must be positive, got -5"),
        (["--micro-batch-size", "0"], "micro_batch_size must be positive, got 0"),
        (["--gpu-memory-gb", "-1"], "gpu_memory_bytes must be positive"),
    ],
)
def test_cli_bad_input_names_the_value(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main([*DIMS, *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_entry_point():
    run = subprocess.run(
        [sys.executable, "-m", "hybrid.plan", *DIMS, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["best"] is not None


def test_cli_takes_a_preset_and_names_an_unknown_one(capsys):
    from hybrid.planner.cli import main

    assert main(["--model", "gpt2-124m", "--seq-length", "1024", "--micro-batch-size", "1",
                 "--num-gpus", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--json"]) in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc
    with pytest.raises(SystemExit):
        main(["--model", "gpt-5", "--seq-length", "1024", "--num-gpus", "8"])
    assert "gpt2-124m" in capsys.readouterr().err
