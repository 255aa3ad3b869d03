"""The per-phase step profile (``hybrid.zero.profile``) and the benchmark's compute-only floor."""

import time

import pytest
import torch

from hybrid.parallel.spawn import spawn_world
from hybrid.zero import profile
from hybrid.zero.profile import PHASES, PhaseTimer, format_profile


def test_nested_phases_are_exclusive(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    t = PhaseTimer()
    with t.phase("backward"):
        clock[0] += 3.0
        with t.phase("hooks"):
            clock[0] += 1.0
            with t.phase("grad_comm"):
                clock[0] += 5.0
            clock[0] += 0.5
        clock[0] += 2.0
    t.end_step()
    got = t.per_step_ms()
    assert got["backward"] == pytest.approx(5000.0)
    assert got["hooks"] == pytest.approx(1500.0)
    assert got["grad_comm"] == pytest.approx(5000.0)
    assert sum(got.values()) == pytest.approx(11500.0)  # the wall time, nothing counted twice
    assert list(got)[:len(PHASES)] == list(PHASES)
    t.reset()
    assert sum(t.per_step_ms().values()) == 0.0
    table = format_profile({"a": got})
    assert table[0] == "| config | backward | hooks | grad_comm | sum |"
    assert table[2] == "| a | 5000.0 | 1500.0 | 5000.0 | 11500.0 |"


def _profiled_steps(rank: int, world: int) -> dict:
    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import parallelize
    from hybrid.zero.comm import replay
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPT, GPTConfig

    grid = ProcessGrid(tp=1)
    out = {}
    for stage in (1, 3):
        for floor in (False, True):
            torch.manual_seed(0)
            model = GPT(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                  vocab_size=256, max_position_embeddings=32,
                                  hidden_dropout=0.0, attention_dropout=0.0))
            engine = parallelize(model, grid, PretrainConfig(
                zero=ZeroConfig(stage=stage, param_persistence_threshold=100),
                optimizer=OptimizerConfig(lr=1e-3)))
            engine.comm.skip_collectives = floor
            timer = PhaseTimer()
            engine.set_profiler(timer)
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
            wall, recorded = 0.0, []
            for i in range(3):
                engine.comm.recorder = recorded if i == 2 and not floor else None
                t0 = time.perf_counter()
                with timer.phase("forward"):
                    loss = engine.model(x, x).mean()
                engine.backward(loss, is_last_micro_batch=True)
                info = engine.step(1e-3)
                wall += time.perf_counter() - t0
                timer.end_step()
            engine.comm.recorder = None
            out[(stage, floor)] = dict(ms=timer.per_step_ms(), wall_ms=1e3 * wall / 3,
                                       comm=info.comm_bytes, recorded=recorded,
                                       replayed=replay(engine.comm, recorded, 2) if recorded
                                       else [])
    return out


@pytest.fixture(scope="module")
def profiled():
    return spawn_world(2, _profiled_steps, timeout_s=120)


@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("stage", [1, 3])
def test_engine_phases_add_up_to_the_step(profiled, stage, floor):
    for rank_out in profiled:
        r = rank_out[(stage, floor)]
        ms = r["ms"]
        for p in ("forward", "backward", "hooks", "optimizer", "refresh", "grad_norm"):
            assert ms[p] > 0.0, (p, ms)
        assert ms["param_gather"] > 0.0 if stage == 3 else ms["param_gather"] == 0.0
        # Every instant of the step is in exactly one phase (a few perf_counter calls outside).
        assert sum(ms.values()) == pytest.approx(r["wall_ms"], rel=0.05, abs=2.0)
        # The floor skips the collectives but still accounts their bytes like the real run.
        assert set(r["comm"]) == {"reduce_scatter", "all_gather", "norm_all_reduce"}
        if floor:
            assert r["recorded"] == [] and r["replayed"] == []
            continue
        # The recorder saw exactly the collectives the byte ledger counted in that step
        # (ring volumes, n = 2), and replaying them alone is timed once per repeat.
        factor = {"all_reduce": 2 * 1 / 2, "reduce_scatter": 1 / 2, "all_gather": 1 / 2 * 2}
        seen = {}
        for op, numel, dtype in r["recorded"]:
            seen[op] = seen.get(op, 0.0) + factor[op] * numel * dtype.itemsize
        assert seen == {k: v for k, v in r["comm"].items() if k != "norm_all_reduce"}
        assert len(r["replayed"]) == 2 and all(t > 0 for t in r["replayed"])


def test_pretrain_profile_phases_flag_logs_phases_and_keeps_the_losses():
    """``--profile-phases`` adds ``phase_<name>_ms`` to each record and changes no loss bit;
    ``--grad-reduce all_reduce`` runs through the job too (ZeRO-1, dp 2)."""
    from tests.pretrain_worlds import run_configs
    from tests.test_golden_losses import ARGV

    # 5 iterations: Megatron-LM's schedule needs the warmup (4) shorter than the decay
    base = [a if a != "20" else "5" for a in ARGV] + ["--zero-stage", "1", "--grad-reduce",
                                                      "all_reduce"]
    plain, profiled = spawn_world(2, run_configs, [base, base + ["--profile-phases"]],
                                  timeout_s=120)[0]
    train = [r for r in profiled if "split" not in r and r.get("kind", "train") == "train"]
    assert len(train) == 5
    for r in train:
        for p in ("forward", "backward", "grad_comm", "optimizer", "refresh"):
            assert r[f"phase_{p}_ms"] > 0.0, (p, r)
        assert (sum(v for k, v in r.items() if k.startswith("phase_"))
                <= r["elapsed_ms"] * 1.05 + 1.0)
    assert [r["lm_loss"] for r in train] == [r["lm_loss"] for r in plain if "split" not in r
                                             and r.get("kind", "train") == "train"]
