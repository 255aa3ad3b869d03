"""Build 5 of issue 33 outside the ZeRO engine, on CPU: no host copy per evaluation
micro-batch, a warning for true fp32 on CUDA, and the torch floor the code needs."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from hybrid.job.cpu_precision import fp32_cuda_message, warn_if_slow
from hybrid.training import evaluate

ROOT = Path(__file__).resolve().parents[1]


def test_evaluation_accumulates_on_the_device():
    # The device is "meta": a tensor there cannot be copied to the host, so any per-micro-batch
    # .cpu() / .item() fails at once; only the final mean may (and does) reach the host.
    calls = []

    def model(x, y):
        calls.append(x.device)
        return torch.ones(x.shape, device="meta")

    engine = types.SimpleNamespace(model=model, eval=lambda: None, train=lambda: None)
    grid = types.SimpleNamespace(device=torch.device("meta"), dp_group=None, dp_size=1)
    batches = iter([torch.zeros(2, 9, dtype=torch.long)] * 3)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta|item|data"):
        evaluate(engine, batches, 3, grid)
    assert len(calls) == 3  # every micro-batch ran before the one host read


def test_torch_floor_covers_enable_gqa():
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 5)  # SDPA enable_gqa is torch 2.5
    uses = [p for p in (ROOT / "models").glob("*.py") if "enable_gqa" in p.read_text()]
    assert uses  # the reason for the floor is still there


def test_true_fp32_on_cuda_warns_and_nothing_else_does(monkeypatch):
    msg = fp32_cuda_message("fp32", "cuda", tf32=False)
    assert "--bf16" in msg and "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in msg
    assert fp32_cuda_message("fp32", "cuda", tf32=True) is None
    assert fp32_cuda_message("bf16", "cuda", tf32=False) is None
    assert fp32_cuda_message("fp32", "cpu", tf32=False) is None
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)
    monkeypatch.setattr(torch._C, "_get_cublas_allow_tf32", lambda: False)
    with pytest.warns(UserWarning, match="true fp32"):
        assert warn_if_slow("fp32", "cuda") == msg
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert warn_if_slow("fp32", "cuda") is None
