"""What ``hybrid.plan`` assumes where it is told nothing (issue 41 item 4, a new user's trial):
its header names the global batch and both bandwidths with where each came from, the network
between nodes is the ``--device`` preset's server's, ``--gpus-per-node 0`` is refused, and the
README's command plans the 100B recipe's batch."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from hybrid.devices import DEVICE_PRESETS
from hybrid.planner import cli as plan_cli

ROOT = Path(__file__).resolve().parents[1]


def plan_json(capsys, *argv) -> dict:
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def header(capsys, *argv) -> list[str]:
    assert plan_cli.main([*argv, "--fitting-only"]) == 0
    return capsys.readouterr().out.splitlines()[:4]


def test_gpus_per_node_0_is_refused_in_one_line(capsys):
    """``--gpus-per-node 0`` planned one node of 8 (0 read as "not given")."""
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as e:
            plan_cli.main(["--model", "gpt2-124m", "--gpus-per-node", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.splitlines() == [
            f"python -m hybrid.plan: error: --gpus-per-node must be positive, got {bad}"], err


def test_the_header_states_the_global_batch_and_both_bandwidths_with_their_sources(capsys):
    lines = header(capsys, "--model", "gpt2-124m", "--num-gpus", "16", "--device", "H100")
    assert lines[2] == (
        "assumed: global batch 16 sequences = 16,384 tokens per step (--micro-batch-size 1 x 16 "
        "GPUs: no --global-batch-size); per GPU, NVLink 200 GB/s (default; --intra-node-gbs), "
        "between nodes 50 GB/s (the H100 preset's: DGX H100, 8 x 400 Gb/s NDR InfiniBand per 8 "
        "GPUs; --inter-node-gbs)")
    given = header(capsys, "--model", "gpt2-124m", "--num-gpus", "8", "--global-batch-size", "64",
                   "--intra-node-gbs", "150", "--inter-node-gbs", "12.5")
    assert given[2] == (
        "assumed: global batch 64 sequences = 65,536 tokens per step (--global-batch-size); per "
        "GPU, NVLink 150 GB/s (--intra-node-gbs), between nodes 12.5 GB/s (unused: one node) "
        "(--inter-node-gbs)")
    custom = header(capsys, "--model", "gpt2-124m", "--device", "V100S", "--gpu-memory-gib", "32")
    assert custom[2].endswith("between nodes 25 GB/s (unused: one node) (default; "
                              "--inter-node-gbs)")


@pytest.mark.parametrize(("device", "gbs"), [("V100-32GB", 6.25), ("A100-40GB", 25.0),
                                             ("A100-80GB", 25.0), ("H100", 50.0), ("H200", 50.0)])
def test_each_device_plans_its_servers_network_between_nodes(capsys, device, gbs):
    """H100 and H200 planned A100's 25 GB/s; a DGX H100 has 8 x 400 Gb/s per 8 GPUs."""
    from hybrid.devices import NETWORK_SOURCES

    adapters, rate, gpus = map(int, re.search(r"(\d+) x (\d+) Gb/s .* per (\d+) GPUs",
                                              NETWORK_SOURCES[device]).groups())
    assert DEVICE_PRESETS[device.lower()].inter_node_gbs == adapters * rate / 8 / gpus == gbs
    doc = plan_json(capsys, "--model", "gpt2-124m", "--num-gpus", "16", "--device", device)
    assert doc["cluster"]["inter_node_gbs"] == gbs
    given = plan_json(capsys, "--model", "gpt2-124m", "--num-gpus", "16", "--device", device,
                      "--inter-node-gbs", "12.5")
    assert given["cluster"]["inter_node_gbs"] == 12.5


def test_the_readmes_plan_command_plans_the_100b_recipes_batch(capsys):
    """The README's ``hybrid.plan --model zero-100b --num-gpus 400 --device H100`` planned a
    400-sequence batch (MFU 13.5%): the preset now brings its run's 1600 sequences of 1024."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("python -m hybrid.plan ")]
    argv = shlex.split(line.split("#")[0])[3:]
    assert argv[:2] == ["--model", "zero-100b"]
    doc = plan_json(capsys, *argv)
    assert doc["training"]["global_batch_size"] == 1600 and doc["training"]["seq_length"] == 1024
    assert doc["defaults_from_preset"] == {"--seq-length": 1024, "--global-batch-size": 1600}
    best = doc["best"]
    assert (best["tp"], best["dp"], best["stage"], best["activation"]) == (8, 50, 3,
                                                                           "sp+selective")
    assert best["mfu"] == pytest.approx(0.336, abs=5e-4)
    with pytest.raises(SystemExit):  # 1600 divides no dp of 48 GPUs: named as the preset's
        plan_cli.main(["--model", "zero-100b", "--num-gpus", "48"])
    assert ("no layout divides the batch: --global-batch-size (1600: the zero-100b preset's) "
            "must be a multiple of") in capsys.readouterr().err
