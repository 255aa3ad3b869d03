"""World functions for the construction-by-unit tests (importable by ``spawn_world``).

``construction_peaks`` builds the ZeRO engine the way ``hybrid.pretrain`` does (a GPT on
``meta``, the TP plan, then ``ZeroEngine(..., weights=seeded_weights(...))``) under torch's
``MemTracker``, which follows every storage allocated during construction, and reports the
peak next to the steady state; ``old_way`` builds the materialised model first (the path
tests and scripts still may use) for comparison.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.tp_plan import parallelize_gpt
from hybrid.parallel.tp_weights import seeded_weights
from hybrid.zero.engine import OptimizerConfig, ZeroConfig, ZeroEngine
from models.gpt import GPT, GPTConfig

if TYPE_CHECKING:  # imported where used: it loads torch's FSDP tools (~1.3 CPU-s per rank)
    from torch.distributed._tools.mem_tracker import MemTracker

SEED = 1234


def _total(mt: MemTracker, kind: str) -> int:
    snap = mt.get_tracker_snapshot(kind)
    return sum(d.get("Total", 0) for dev, d in snap.items() if torch.device(dev).type != "meta")


def _build(grid, cfg: GPTConfig, stage: int, materialised: bool):
    with torch.device("meta"):
        model = GPT(cfg)
    if materialised:
        parallelize_gpt(model, grid.tp_group, seed=SEED)
        weights = None
    else:
        parallelize_gpt(model, grid.tp_group)
        weights = seeded_weights(cfg, SEED)
    zc = ZeroConfig(stage=stage, precision="bf16", reduce_bucket_size=200_000,
                    allgather_bucket_size=200_000, param_persistence_threshold=0)
    return ZeroEngine(model, grid, zc, OptimizerConfig(lr=1e-3), weights=weights)


def construction_peaks(rank: int, world: int, model_kw: dict, builds, tp: int = 1) -> dict:
    """Per ``(stage, materialised)`` of ``builds``: ``peak`` (bytes tracked at the construction
    peak), ``steady`` (tracked once
    built: model states + buffers), ``unit_fp32`` (the largest unit's fp32 bytes),
    ``states`` (``engine.memory_bytes()`` params + grads + master + optimizer)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    grid = ProcessGrid(tp=tp)
    cfg = GPTConfig(**model_kw, hidden_dropout=0.0, attention_dropout=0.0)
    out = {}
    for stage, materialised in builds:
        with MemTracker() as mt:
            engine = _build(grid, cfg, stage, materialised)
        mem = engine.memory_bytes()
        out[stage, materialised] = dict(peak=_total(mt, "peak"), steady=_total(mt, "current"),
                          unit_fp32=4 * max(u.padded for u in engine.layout.units),
                          param_fp32=4 * max(s.numel for s in engine.layout.slots),
                          states=sum(mem[k] for k in ("params", "grads", "master", "optimizer")),
                          buffers=mem["buffers"], local_params=engine.layout.numel)
        del engine, mt
    return out


def same_as_materialised(rank: int, world: int, model_kw: dict, stages, tp: int) -> dict:
    """Per stage: max |difference| of master and compute parameters between the engine built by unit
    from ``seeded_weights`` and the one built from a materialised seeded model, and after
    ``load_weights(full_weights(GPT.init_weights(seed)))``; 0.0 means bit-equal."""
    grid = ProcessGrid(tp=tp)
    cfg = GPTConfig(**model_kw, hidden_dropout=0.0, attention_dropout=0.0)
    return {stage: _compare(grid, cfg, stage) for stage in stages}


def _compare(grid, cfg: GPTConfig, stage: int) -> dict:
    from hybrid.parallel.tp_weights import full_weights

    a, b = _build(grid, cfg, stage, False), _build(grid, cfg, stage, True)

    def diff(x, y):
        return (x.float() - y.float()).abs().max().item()

    def compute(e):
        return e.states.param_flat if e.states.param_flat is not None else e.states.param_shard

    out = dict(master=diff(a.states.master, b.states.master), params=diff(compute(a), compute(b)))
    ref = GPT(cfg)
    ref.init_weights(SEED + 1)
    a.load_weights(full_weights(ref.state_dict()))
    c = ZeroEngine(parallelize_gpt(ref, grid.tp_group), grid, a.config, a.opt_config)
    out.update(loaded_master=diff(a.states.master, c.states.master),
               loaded_params=diff(compute(a), compute(c)))
    return out


def stage3_engine_lines(rank: int, world: int, model_kw: dict, thresholds) -> dict:
    """``hybrid.zero.accounting.engine_line`` of a stage-3 engine per persistence threshold."""
    from hybrid.zero.accounting import engine_line

    grid = ProcessGrid(tp=1)
    cfg = GPTConfig(**model_kw, hidden_dropout=0.0, attention_dropout=0.0)
    out = {}
    for threshold in thresholds:
        with torch.device("meta"):
            model = GPT(cfg)
        parallelize_gpt(model, grid.tp_group)
        zc = ZeroConfig(stage=3, param_persistence_threshold=threshold)
        engine = ZeroEngine(model, grid, zc, OptimizerConfig(lr=1e-3),
                            weights=seeded_weights(cfg, SEED))
        out[threshold] = engine_line(engine)
    return out
