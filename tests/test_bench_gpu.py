"""``scripts/bench_gpu.py`` stays runnable: its ``--smoke`` mode (tiny GPT, CPU) runs end to end,
and without a GPU the real mode refuses with status 2 instead of running on CPU."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod  # spawned ranks unpickle bench_gpu.run_ours by name
    spec.loader.exec_module(mod)
    return mod


def test_smoke_writes_report(tmp_path):
    assert _load().main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert len(res["results"]) == 2
    ours, plain = res["results"].values()
    assert ours["params"] == plain["params"]  # both pad the 500-token vocabulary to 512
    for r in res["results"].values():
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
    assert {"checkpoint", "Pa", "Pa + arena"} <= set(res["activations"])
    assert (tmp_path / "gpu_smoke.png").stat().st_size > 0
    assert "tokens/s" in (tmp_path / "gpu_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_gpu(capsys):
    assert _load().main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_the_activation_measurement_splits_the_heads():
    mod = _load()
    assert [mod.pa_tp_for(h) for h in (25, 16, 12, 7)] == [5, 2, 2, 7]  # gpt2-1.5b: 25 heads
    import gpu_activation_memory as G

    with pytest.raises(ValueError, match="25 attention heads do not split over tp 2"):
        G.run(num_layers=1, hidden_size=50, heads=25, tp=2, device="cpu")
