"""The planner with ZeRO-Offload (arXiv 2101.06840; Megatron-LM's --optimizer-cpu-offload and
--optimizer-offload-fraction): the device / host byte split, host memory per node as a limit,
the offloaded optimizer's seconds, the search, and the CLI's flags and JSON."""

import json

import pytest

from hybrid import flops
from hybrid.devices import GIB
from hybrid.planner import cli as plan_cli
from hybrid.planner import plan
from tests.test_flops import gpt

# GPT-2 shape, 2 layers, h = 64, V = 128 (a multiple of 128: no padding at tp 1), s = 32:
# Psi = Vh + sh + L(12h^2 + 13h) + 2h = 8192 + 2048 + 2 (49152 + 832) + 128 = 110,336
SMALL = gpt(2, 64, 4, v=128, s=32)
PSI = 110_336
PARTITION = PSI // 4  # dp 4 divides it: 27,584 elements per rank
CLUSTER = plan.Cluster(num_gpus=4, gpus_per_node=4, reserved_bytes=0, cpu_gbs=10.0,
                       host_memory_gbs=100.0, host_efficiency=0.5)
TRAINING = plan.Training(seq_length=32, accounting="engine")


def evaluate(fraction, cluster=CLUSTER, activation="none"):
    return plan.evaluate(SMALL, cluster, TRAINING, 1, 1, activation, fraction)


def test_the_byte_split_by_hand():
    assert flops.num_parameters(SMALL) == PSI
    off, half, full = evaluate(0.0), evaluate(0.5), evaluate(1.0)
    # engine bf16 at stage 1: 2 B params and 4 B gradients whole, 4 B master + 8 B Adam sharded
    assert off.model_states == {"params": 2 * PSI, "grads": 4 * PSI, "master": 4 * PARTITION,
                                "optimizer": 8 * PARTITION, "total": 6 * PSI + 12 * PARTITION}
    assert off.host_bytes == {"states": 0, "checkpoints": 0, "rank": 0, "node": 0}
    assert full.model_states == {"params": 2 * PSI, "grads": 4 * PSI, "master": 0,
                                 "optimizer": 0, "total": 6 * PSI}
    # the host keeps the fp32 master, both moments and the gradient copy: 16 B per element
    assert full.host_bytes == {"states": 16 * PARTITION, "checkpoints": 0,
                               "rank": 16 * PARTITION, "node": 4 * 16 * PARTITION}
    assert off.total_bytes - full.total_bytes == 12 * PARTITION
    kept = PARTITION - PARTITION // 2  # 13,792 each
    assert (half.model_states["master"], half.model_states["optimizer"]) == (4 * kept, 8 * kept)
    assert half.host_bytes["states"] == 16 * (PARTITION // 2)
    assert full.offload_bytes == (4 + 2) * PARTITION  # fp32 gradients down, bf16 params up
    # P_a+cpu's checkpoints count against the host too
    cpu = plan.evaluate(SMALL, CLUSTER, TRAINING, 2, 1, "full+pa+cpu", 1.0)
    assert cpu.host_bytes["checkpoints"] == cpu.activations["cpu"] > 0
    assert cpu.host_bytes["node"] == 4 * (cpu.host_bytes["states"] + cpu.activations["cpu"])


def test_the_offloaded_optimizer_seconds_by_hand():
    off, full = evaluate(0.0), evaluate(1.0)
    t = full.times
    assert t["offload_d2h_s"] == pytest.approx(4 * PARTITION / 10e9)
    assert t["offload_h2d_s"] == pytest.approx(2 * PARTITION / 10e9)
    # 4 ranks share the node's DRAM; AdamW touches 2 x 12 + 4 + 2 x 2 = 32 B per element
    assert t["host_adam_s"] == pytest.approx(4 * PARTITION * 32 / (100e9 * 0.5))
    adam, h2d = t["host_adam_s"], t["offload_h2d_s"]
    assert t["host_step_s"] == pytest.approx(max(adam, h2d) + min(adam, h2d) / 3)  # N + 1 units
    assert t["optimizer_s"] == pytest.approx(max(t["device_optimizer_s"], t["host_step_s"]))
    assert t["device_optimizer_s"] < off.times["optimizer_s"]  # only the norm's read stays
    assert 0 < t["offload_exposed_s"] <= t["offload_d2h_s"]
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_s"])
    assert off.times["offload_exposed_s"] == off.times["host_step_s"] == 0.0
    # nothing else changes: the step is longer by the optimizer's and the copy's difference
    extra = t["optimizer_s"] - off.times["optimizer_s"] + t["offload_exposed_s"]
    assert t["step_s"] == pytest.approx(off.times["step_s"] + extra)


def test_the_host_limit_refuses():
    need = evaluate(1.0).host_bytes["node"]
    small_host = plan.Cluster(**{**CLUSTER.__dict__, "host_memory_bytes": need - 1})
    c = evaluate(1.0, small_host)
    assert c.device_fits and not c.host_fits and not c.fits
    assert evaluate(0.0, small_host).fits
    assert plan.best([c]) is None


def test_stage_0_and_bad_fractions_are_refused():
    with pytest.raises(ValueError, match="offloads the partition of ZeRO 1-3"):  # ZeroConfig's
        plan.evaluate(SMALL, CLUSTER, TRAINING, 1, 0, "none", 1.0)
    with pytest.raises(ValueError, match=r"--optimizer-offload-fraction 1.5 .*\[0, 1\]"):
        evaluate(1.5)
    cands, skipped = plan.plan(SMALL, CLUSTER, TRAINING, [1], offload_fractions=(1.0,))
    assert {c.stage for c in cands} == {1, 2, 3} and {c.offload_fraction for c in cands} == {1.0}
    assert any("offloads the partition of ZeRO 1-3" in r for r in skipped)


def test_the_search_picks_offload_only_when_it_is_the_only_way_to_fit():
    m = gpt(48, 1600, 16, v=50257, s=1024)
    training = plan.Training(seq_length=1024)
    tiny = plan.Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_bytes=1 * GIB, reserved_bytes=0)
    assert plan.best(plan.plan(m, tiny, training, offload_fractions=(0.0,))[0]) is None
    chosen = plan.best(plan.plan(m, tiny, training)[0])  # the default search: off and on
    assert chosen.fits and chosen.offload_fraction == 1.0
    roomy = plan.Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GIB)
    cands = plan.plan(m, roomy, training)[0]
    assert {c.offload_fraction for c in cands} == {0.0, 0.5, 1.0}
    assert plan.best(cands).offload_fraction == 0.0  # offload only costs time when it fits


def cli_json(capsys, *argv) -> dict:
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


DIMS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "128", "--seq-length", "32", "--num-gpus", "4", "--tp", "1",
        "--activation", "none"]


def test_the_cli_flags_and_json(capsys):
    doc = cli_json(capsys, *DIMS, "--device", "H100", "--optimizer-cpu-offload",
                   "--optimizer-offload-fraction", "0.5")
    assert doc["cluster"]["host_memory_bytes"] == 2048 * GIB  # the H100 preset's DGX
    assert (doc["cluster"]["cpu_gbs"], doc["cluster"]["host_memory_gbs"]) == (50.4, 614.4)
    assert {c["offload_fraction"] for c in doc["candidates"]} == {0.5}
    best = doc["best"]
    assert best["offload_fraction"] == 0.5 and best["host_fits"] and best["device_fits"]
    assert best["host_bytes"]["node"] == 4 * best["host_bytes"]["rank"] > 0
    assert best["times"]["host_step_s"] > 0 and best["offload_bytes"] > 0
    assert doc["offload_fractions"] == [0.5]
    doc = cli_json(capsys, *DIMS, "--no-optimizer-cpu-offload")
    assert {c["offload_fraction"] for c in doc["candidates"]} == {0.0}
    assert doc["offload_fractions"] == [0.0]
    assert cli_json(capsys, *DIMS)["offload_fractions"] == [0.0, 0.5, 1.0]  # the search
    doc = cli_json(capsys, *DIMS, "--host-memory-gib", "0.0005", "--host-dram-gbs", "50")
    assert doc["cluster"]["host_memory_gbs"] == 50
    refused = [c for c in doc["candidates"] if c["device_fits"] and not c["host_fits"]]
    assert {(c["stage"], c["offload_fraction"]) for c in refused} == {
        (z, f) for z in (1, 2, 3) for f in (0.5, 1.0)}
    assert plan_cli.main([*DIMS, "--host-memory-gib", "0.0005"]) == 0
    out = capsys.readouterr().out
    assert " hst " in out and "refused 6 layouts that fit the GPU: their host bytes per node " \
        "exceed --host-memory-gib 0.0005" in out


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction 1.5 (ZeroConfig.optimizer_offload_fraction): must be a "
     "number in [0, 1]"),
    (["--host-memory-gib", "0"], "--host-memory-gib must be positive"),
    (["--optimizer-cpu-offload", "--no-optimizer-cpu-offload"], "not allowed with argument"),
])
def test_the_cli_refuses_bad_offload_input(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        plan_cli.main([*DIMS, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_one_node_that_only_trains_with_offload(capsys):
    """A 40B GPT on one node of 8 H100: the optimizer has to go to the host."""
    argv = ["--model", "zero-40b", "--num-gpus", "8", "--device", "H100", "--seq-length",
            "2048", "--micro-batch-size", "2", "--global-batch-size", "64", "--tp", "2",
            "--zero-stage", "3", "--activation", "sp", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    assert cli_json(capsys, *argv, "--no-optimizer-cpu-offload")["best"] is None
    best = cli_json(capsys, *argv)["best"]
    assert best["offload_fraction"] == 1.0 and best["fits"]
    assert best["host_bytes"]["node"] < 2048 * GIB


def test_max_model_with_the_optimizer_on_the_host(capsys):
    from hybrid.planner.max_model import max_params, max_params_offloaded

    # one GPU, engine bf16: 2 + 4 + 12 = 18 B/param on the GPU, 2 + 4 = 6 with the 12 offloaded
    gpu, host = 60 * GIB, 2048 * GIB
    assert max_params(gpu, 1, 1, 1, "bf16", "engine") == gpu // 18
    assert max_params_offloaded(gpu, host, 1, 1, 1, 1, "bf16", "engine") == gpu // 6
    assert max_params_offloaded(gpu, host, 1, 1, 1, 1, "bf16", "paper") == gpu // 4  # 16 -> 4
    # the host bounds it too: 8 ranks x 16 B per parameter of the node's model
    assert max_params_offloaded(gpu, 64 * GIB, 8, 1, 1, 1, "bf16", "engine") == 64 * GIB // 128
    # stage 2, dp 4, half offloaded: 2 + (4 + 12 - 6) / 4 = 4.5 B on the GPU
    assert max_params_offloaded(gpu, host, 4, 1, 4, 2, "bf16", "engine", 0.5) == int(gpu / 4.5)
    assert max_params_offloaded(gpu, host, 1, 1, 1, 0) == 0
    rows = cli_json(capsys, "--max-model", "--device", "H100", "--num-gpus", "1")["max_model"]
    assert [r["max_params_offloaded"] is None for r in rows] == [True, False, False, False]
    on_host, on_gpu = rows[1]["max_params_offloaded"], rows[1]["max_params_model_states"]
    assert abs(on_host - 3 * on_gpu) <= 3  # 18 / 6 B per parameter, each floored
