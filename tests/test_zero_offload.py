"""ZeRO-Offload (``--optimizer-cpu-offload``, issue 35 items 1-2): the optimizer of the partition in
host memory gives the losses of the device optimizer, and checkpoints move between offloaded and
device-kept runs on any grid.

Right values: training losses with offload equal to those without, bitwise (fp32 on CPU: the
host AdamW's foreach arithmetic is the device single-tensor one, element for element; the
acceptance asks 1e-6, we assert exact and would still pass at 1e-12) at (tp, dp, stage) =
(1, 4, 1), (2, 2, 2), (2, 2, 3) with dropout 0.1; a resume of an offloaded checkpoint without
offload equal to the straight run; a tp1 x dp4 stage-1 checkpoint resharded onto tp2 x dp2
stage 2 giving the same losses whether the saving or the loading run offloads (half of the
partition with ``--optimizer-offload-fraction 0.5`` and ``--overlap-param-gather``).
One spawned 4-rank world runs the 12 trainings (tiny model, 2-4 iterations each); a 2-rank
world checks bf16 gradients, fp16 overflow skipping and a 0.3 fraction at the engine, bitwise.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.config_fields import ConfigError
from hybrid.parallel.spawn import spawn_world
from hybrid.zero.config import ZeroConfig
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.offload import SplitFlat, host_split
from tests.pretrain_worlds import run_configs
from tests.test_resume_exact import MOCK, train_losses

OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-cpu-threads", "1"]


def _grid(tp: int, stage: int, iters: int) -> list[str]:
    return MOCK + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage),
                   "--train-iters", str(iters), "--eval-interval", "1000"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload")
    grids = [(1, 1), (2, 2), (2, 3)]
    argvs = [_grid(tp, st, 4) + extra for tp, st in grids for extra in ([], OFFLOAD)]
    ck = {k: str(d / k) for k in ("resume", "off", "on")}
    argvs += [_grid(2, 3, 2) + OFFLOAD + ["--save", ck["resume"]],          # offloaded save
              _grid(2, 3, 4) + ["--load", ck["resume"]],                    # device resume
              _grid(1, 1, 2) + OFFLOAD + ["--save", ck["on"]],              # tp1 dp4 z1
              _grid(1, 1, 2) + ["--save", ck["off"]],                       # 9
              _grid(2, 2, 4) + ["--overlap-param-gather", "--load", ck["on"]],  # tp2 dp2 z2
              _grid(2, 2, 4) + OFFLOAD + ["--optimizer-offload-fraction", "0.5",
                                          "--overlap-param-gather", "--load", ck["off"]]]
    histories = spawn_world(4, run_configs, argvs, timeout_s=120)[0]
    return [train_losses(h) for h in histories]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("i,grid", [(0, "tp1 dp4 z1"), (2, "tp2 dp2 z2"), (4, "tp2 dp2 z3")])
def test_offloaded_losses_equal_device_optimizer_with_dropout(runs, i, grid):
    assert sorted(runs[i]) == [1, 2, 3, 4], grid
    assert runs[i + 1] == runs[i], grid  # bitwise


@pytest.mark.timeout(900)
def test_offloaded_checkpoint_resumes_without_offload_exactly(runs):
    assert runs[6] == {i: runs[4][i] for i in (1, 2)}
    assert runs[7] == {i: runs[4][i] for i in (3, 4)}


@pytest.mark.timeout(900)
def test_reshard_between_offloaded_and_device_runs(runs):
    assert runs[8] == runs[9] == {i: runs[0][i] for i in (1, 2)}
    assert sorted(runs[10]) == [3, 4]
    assert runs[10] == runs[11]  # offloaded save -> device load == device save -> offloaded load


def test_offload_config_is_checked_before_any_process_group():
    with pytest.raises(ConfigError, match=r"--optimizer-cpu-offload True .*--zero-stage 1, 2 or 3"):
        ZeroConfig(stage=0, optimizer_cpu_offload=True)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ConfigError, match=r"--optimizer-offload-fraction .*\[0, 1\]"):
            ZeroConfig(stage=1, optimizer_cpu_offload=True, optimizer_offload_fraction=bad)
    assert ZeroConfig(stage=2, optimizer_offload_fraction=0.3).offload_fraction == 0.0


def test_host_split_takes_units_in_flat_order_until_the_fraction():
    # units of 16 + 40 + 40 + 40 elements -> shards of 4, 10, 10, 10 at dp 4 (padded to 8 * dp)
    entries = [("a", (16,), False, False, "root")] + [
        (f"l{i}", (40,), False, False, f"layers.{i}") for i in range(3)]
    L = PartitionLayout(entries, ["root", "layers.0", "layers.1", "layers.2"], 4, 1)
    shards = [u.shard for u in L.units]
    assert host_split(L, 0.0) == 0
    assert host_split(L, 1.0) == L.partition_numel == sum(shards)
    assert host_split(L, 0.5) == sum(shards[:3])  # offloaded while below half: 3 units
    s = SplitFlat(L.partition_numel, shards[0], torch.device("cpu"))
    assert s[0:shards[0]].data_ptr() == s.host.data_ptr()
    assert s[shards[0]:shards[0] + 2].data_ptr() == s.device_part.data_ptr()
    with pytest.raises(ValueError, match="crosses the host/device split"):
        s[0:shards[0] + 1]


@pytest.mark.timeout(600)
def test_bf16_gradients_fp16_skips_and_a_fraction_are_bitwise_too():
    from tests.zero_worlds import offload_world

    got = spawn_world(2, offload_world, timeout_s=120)[0]
    for name, r in got.items():
        assert r["losses_equal"] and r["diff"] == 0.0, (name, r)
        assert r["skipped"][0] == r["skipped"][1], name
        assert r["host"] > 0, name
    assert got["z1_fp16_skips"]["skipped"][0] == [True] * 3  # 2^32 overflows: the skip path
    host, whole = got["z3_fraction_0.3"]["split"]
    assert 0.3 * whole <= host < whole  # units offloaded in flat order until 30% is reached
