"""The planner's prediction next to what :class:`hybrid.zero.engine.ZeroEngine` measures, for one
run.

``predict`` asks :func:`hybrid.planner.plan.evaluate` (``accounting="engine"``) for one rank's
model-state bytes and data-parallel bytes per optimizer step; ``measure`` builds the same GPT on a
process grid, runs one optimizer step of ``micro_batches`` micro-batches and reads
``engine.memory_bytes()`` and the step's ledger (``StepInfo.comm_bytes``); ``compare`` gives the
relative errors. Used by ``tests/test_plan_vs_engine.py`` and ``scripts/bench_accounting.py``.

The ledger's ``norm_all_reduce`` (16 bytes over the world for the grad norm and overflow flag)
is not data-parallel traffic of the model states and is left out of ``dp_total``. The only
expected differences are the layout's padding (each unit rounded up to ``dp * 8`` elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid.planner.plan import Cluster, Training, evaluate
from hybrid.zero.config import ZeroConfig

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid

STATE_KEYS = ("params", "grads", "master", "optimizer")
DP_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class CheckRun:
    """One configuration: model, layout, the run's ZeRO settings and the step it runs."""

    model: dict
    """``models.gpt.GPTConfig`` keyword arguments (unpadded vocabulary; dropout should be 0)."""
    tp: int
    dp: int
    zero: ZeroConfig
    """The engine's settings (stage, precision, buckets, gradient collective, ZeRO++); the
    planner is given the same (:func:`predict`)."""
    micro_batches: int = 1
    """Gradient-accumulation steps in the one optimizer step."""
    seq_length: int = 16
    micro_batch_size: int = 1

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def precision(self) -> str:
        return self.zero.precision

    @property
    def name(self) -> str:
        z = self.zero
        persist = z.plan.persistence_threshold
        return (f"tp{self.tp}xdp{self.dp} z{z.stage} {z.precision} m={self.micro_batches}"
                + (f" persist<{persist}" if persist else "")
                + (f" {z.grad_reduce}" if z.grad_reduce != "reduce_scatter" else "")
                + (" bf16-grads" if z.grad_reduce_in_bf16 else "")
                + (f" hpz{z.hpz_partition_size}" if z.hpz_partition_size > 1 else "")
                + (" qwz" if z.quantized_weights else ""))


def predict(run: CheckRun) -> dict:
    """Planner figures for ``run``: ``{'states': {key: bytes, 'total'}, 'dp': {kind: bytes},
    'dp_total': bytes}`` per rank (per optimizer step for traffic)."""
    from models.config import GPTConfig

    n = run.tp * run.dp
    cluster = Cluster(num_gpus=n, gpus_per_node=n, reserved_bytes=0)
    training = Training(
        seq_length=run.seq_length,
        micro_batch_size=run.micro_batch_size,
        global_batch_size=run.micro_batch_size * run.dp * run.micro_batches,
        accounting="engine",
        zero=run.zero,
    )
    c = evaluate(GPTConfig(**run.model), cluster, training, run.tp, run.stage, "none")
    states = {k: c.model_states[k] for k in STATE_KEYS}
    states["total"] = sum(states.values())
    return dict(states=states, dp=dict(c.dp_bytes_by_kind), dp_total=c.dp_bytes)


def measure(grid: ProcessGrid, run: CheckRun, seed: int = 1234) -> dict:
    """Build ``run``'s GPT + ZeroEngine on ``grid`` (tp, dp must match), run one optimizer step
    on random tokens, return the same dict as ``predict`` from the engine's own accounting.
    Collective over the grid (every rank calls)."""
    from hybrid.config import PretrainConfig
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig
    from models.gpt import GPT, GPTConfig

    if (grid.tp_size, grid.dp_size) != (run.tp, run.dp):
        raise ValueError(f"grid is tp{grid.tp_size} x dp{grid.dp_size}, run wants "
                         f"tp{run.tp} x dp{run.dp}")
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**run.model, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    engine = parallelize(GPT(cfg), grid,
                         PretrainConfig(zero=run.zero, optimizer=OptimizerConfig(lr=1e-3)))
    g = torch.Generator().manual_seed(seed + grid.dp_rank)
    for m in range(run.micro_batches):
        tokens = torch.randint(0, cfg.vocab_size, (run.micro_batch_size, run.seq_length + 1),
                               generator=g).to(grid.device)
        loss = engine.model(tokens[:, :-1], tokens[:, 1:]).mean() / run.micro_batches
        engine.backward(loss, is_last_micro_batch=m == run.micro_batches - 1)
    info = engine.step(1e-3)
    held = engine.memory_bytes()
    states = {k: held[k] for k in STATE_KEYS}
    states["total"] = sum(states.values())
    dp = {k: info.comm_bytes.get(k, 0.0) for k in DP_KINDS}
    return dict(states=states, dp=dp, dp_total=sum(dp.values()),
                other_comm={k: v for k, v in info.comm_bytes.items() if k not in DP_KINDS},
                padded_numel=engine.layout.total_numel, numel=engine.layout.numel)


def measure_world(rank: int, world_size: int, runs: list[CheckRun]) -> dict:
    """Run inside a spawned world: :func:`measure` every run, one grid per tp; rank r returns
    ``{run.name: measured}``."""
    from hybrid.parallel.grid import ProcessGrid

    out = {}
    for tp in sorted({r.tp for r in runs}):
        grid = ProcessGrid(tp=tp)
        for run in (r for r in runs if r.tp == tp):
            out[run.name] = measure(grid, run)
    return out


def _rel(pred: float, meas: float) -> float:
    if meas == 0:
        return 0.0 if pred == 0 else float("inf")
    return (pred - meas) / meas


def compare(pred: dict, meas: dict) -> dict:
    """Relative errors (predicted - measured) / measured of every state key, the state total,
    every DP kind and the DP total (0 when both are 0)."""
    out = {f"states.{k}": _rel(pred["states"][k], meas["states"][k]) for k in pred["states"]}
    out.update({f"dp.{k}": _rel(pred["dp"][k], meas["dp"][k]) for k in DP_KINDS})
    out["dp_total"] = _rel(pred["dp_total"], meas["dp_total"])
    return out


def check_run(model: dict, tp: int, dp: int, stage: int, precision: str = "bf16",
              micro_batches: int = 1, **zero) -> CheckRun:
    """A :class:`CheckRun` whose ZeroConfig has buckets of 20,000 elements (the traffic does not
    depend on them), no persistence threshold unless ``zero`` gives one, and ``zero``'s other
    fields."""
    settings = dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                    param_persistence_threshold=0) | zero
    return CheckRun(model, tp, dp, ZeroConfig(stage=stage, precision=precision, **settings),
                    micro_batches)


def default_runs(model: dict, world: int = 4) -> list[CheckRun]:
    """The grid of checks: stages 0-3 x (tp, dp) in {(1, world), (2, world/2)} x bf16/fp32 x
    1 and 2 micro-batches, plus stage 3 with a persistence threshold that keeps the biases and
    LayerNorms whole, plus stages 1-3 with ``grad_reduce="all_reduce"``, plus stages 0-3 with
    bf16 gradients (``grad_reduce_in_bf16``), plus stage 3 with ZeRO++ (hpZ over 2 ranks, qwZ,
    both) at tp 1."""
    out = []
    for tp in (1, 2):
        dp = world // tp
        for stage in range(4):
            for precision in ("bf16", "fp32"):
                for micro in (1, 2):
                    out.append(check_run(model, tp, dp, stage, precision, micro))
        out += [check_run(model, tp, dp, 3, "bf16", 2, param_persistence_threshold=1000),
                check_run(model, tp, dp, 3, "fp32", 1, param_persistence_threshold=1000)]
        out += [check_run(model, tp, dp, stage, "bf16", 2, grad_reduce="all_reduce")
                for stage in (1, 2, 3)]
        out += [check_run(model, tp, dp, stage, "bf16", 2, grad_reduce_in_bf16=True)
                for stage in range(4)]
    out += [check_run(model, 1, world, 3, "bf16", 2, hpz_partition_size=2),
            check_run(model, 1, world, 3, "bf16", 2, hpz_partition_size=2, quantized_weights=True),
            check_run(model, 1, world, 3, "bf16", 2, quantized_weights=True)]
    return out
