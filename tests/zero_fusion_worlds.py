"""World functions for the ZeRO engine's issue-33 paths (importable): gradient-accumulation
fusion, ``--overlap-param-gather``, ``--grad-reduce-in-bf16`` and clipping of the owned fragments.

Exactness is checked against the unfused engine on the same grid, weights, data and dropout
stream (dropout 0 and 0.1): the paths change where gradients are written and when parameters are
gathered, not the arithmetic, so losses and final states must agree bit for bit (dp is a power of
two, so averaging after the sum instead of before is exact). Parity with the single-process
model (dropout 0) is in ``tests/test_zero.py`` (its variants run with fusion on, the default,
and off).
"""

from __future__ import annotations

import functools

import torch

from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.rng import RNGTracker
from hybrid.zero import state
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from tests.tiny import build_parallel
from tests.zero_worlds import CFG, OPT, micro_batch, train

BASE = dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
            param_persistence_threshold=100)
SMALL = dict(reduce_bucket_size=3_000, allgather_bucket_size=3_000)
PATHS = {"unfused": dict(gradient_accumulation_fusion=False),
         "unfused_small_buckets": dict(gradient_accumulation_fusion=False, **SMALL),
         "fused": dict(gradient_accumulation_fusion=True),
         "fused_small_buckets": dict(SMALL),
         "overlap_param_gather": dict(overlap_param_gather=True),
         "param_gather_unfused": dict(overlap_param_gather=True,
                                      gradient_accumulation_fusion=False)}
"""The paths run; each is compared with its :data:`BASELINE` (today's path before issue 33)."""
BASELINE = {"fused": "unfused", "fused_small_buckets": "unfused_small_buckets",
            "overlap_param_gather": "unfused", "param_gather_unfused": "unfused"}


def build(grid: ProcessGrid, stage: int, dropout: float = 0.0, **kw):
    zc = ZeroConfig(stage=stage, **dict(BASE, **kw))
    return build_parallel(grid, dict(CFG, hidden_dropout=dropout, attention_dropout=dropout),
                          zero=zc, optimizer=OptimizerConfig(**OPT),
                          tracker=RNGTracker(seed=77, tp_rank=grid.tp_rank))


def _run(grid, stage, dropout, kw, steps=3) -> dict:
    e = build(grid, stage, dropout, **kw)
    torch.manual_seed(5)  # the dropout stream of the default generator, the same in every run
    r = train(e, grid, steps=steps)
    views = sum(v is not None for v in e.reducer.main_grad)
    e.close()
    return dict(losses=r["losses"], final=r["final"], norms=[i["grad_norm"] for i in r["infos"]],
                main_grad_views=views, params=len(e.params))


def exactness(grid: ProcessGrid, rank0: bool) -> dict:
    """Every path x stage x dropout: ``(losses, norms, final state)`` equal to the unfused run."""
    out = {}
    for dropout in (0.0, 0.1):
        for stage in range(4):
            runs = {}
            for name, kw in PATHS.items():
                if stage == 0 and kw.get("overlap_param_gather"):
                    continue  # refused: stage 0 gathers nothing
                if grid.tp_size > 1 and "small_buckets" in name:
                    continue  # bucket sizes change only the dp collectives: run at dp 4
                runs[name] = _run(grid, stage, dropout, kw)
            for name, r in runs.items():
                base = runs[BASELINE.get(name, name)]
                out[(stage, dropout, name)] = dict(
                    same=(r["losses"] == base["losses"] and r["norms"] == base["norms"]
                          and all(torch.equal(r["final"][k], base["final"][k])
                                  for k in base["final"])),
                    main_grad_views=r["main_grad_views"], params=r["params"])
    return out


def param_gather(grid: ProcessGrid) -> dict:
    """``--overlap-param-gather`` at stage 1: what is in flight after ``step``, what each block's
    pre-hook found, and that eval, checkpoint reads and state export wait first."""
    res = {}
    ref, e = build(grid, 1, **PATHS["unfused"]), build(grid, 1, overlap_param_gather=True)
    for eng in (ref, e):
        x, y = micro_batch(0, grid.dp_rank, grid.dp_size, 0)
        eng.backward(eng.model(x, y).mean(), is_last_micro_batch=True)
        eng.step(OPT["lr"])
    names = [u.name for u in e.layout.units]
    res["in_flight_after_step"] = e.deferred.in_flight
    res["units"] = len(names)
    seen = {}
    def look(i, module, args):
        seen.setdefault(i, [bool(w) for w in e.deferred.works])

    for i, block in enumerate(e.model.layers):  # registered after the engine's: runs after it
        block.register_forward_pre_hook(functools.partial(look, i))
    x, y = micro_batch(1, grid.dp_rank, grid.dp_size, 0)
    with torch.no_grad():  # an evaluation forward: the hooks wait unit by unit
        res["eval"] = (e.eval().model(x, y).mean().item(), ref.eval().model(x, y).mean().item())
    res["pending_at_block"] = {i: [n for n, w in zip(names, ws, strict=True) if w]
                               for i, ws in seen.items()}
    res["in_flight_after_eval"] = e.deferred.in_flight
    e.train(), ref.train()
    for eng in (ref, e):
        eng.backward(eng.model(x, y).mean(), is_last_micro_batch=True)
        eng.step(OPT["lr"])
    res["in_flight_before_save"] = e.deferred.in_flight
    list(state.owned_state(e))  # what a checkpoint save reads
    res["in_flight_after_save"] = e.deferred.in_flight
    res["params_equal"] = torch.equal(e.states.param_flat, ref.states.param_flat)
    full = e.model_state_dict_full()  # consolidation's read
    want = ref.model_state_dict_full()
    res["export_equal"] = all(torch.equal(full[k], want[k]) for k in want)
    e.close(), ref.close()
    return res


def bf16_grads(grid: ProcessGrid) -> dict:
    """20 steps of bf16 training with bf16 gradients (``--grad-reduce-in-bf16``) and with fp32
    gradients, stages 0-3: losses, the gradient buffer's dtype and bytes."""
    out = {}
    for stage in range(4):
        for bf16 in (False, True):
            e = build(grid, stage, precision="bf16", grad_reduce_in_bf16=bf16)
            r = train(e, grid, steps=20)
            out[(stage, bf16)] = dict(losses=r["losses"], grad_dtype=e.reducer.buffer.dtype,
                                      grad_bytes=e.memory_bytes()["grads"],
                                      master_dtype=e.states.master.dtype)
            e.close()
    return out


def clipping(grid: ProcessGrid) -> dict:
    """Gradient elements the clip multiplies at stage 1 (the owned fragments, not the whole
    flat gradient): ``torch._foreach_mul_`` and ``Tensor.mul_`` wrapped during ``step``, counting
    the elements that lie in the engine's gradient buffer."""
    e = build(grid, 1)
    x, y = micro_batch(0, grid.dp_rank, grid.dp_size, 0)
    e.backward(e.model(x, y).mean() * 100, is_last_micro_batch=True)  # a norm far above the clip
    ptr = e.reducer.buffer.untyped_storage().data_ptr()
    counted = []
    real_foreach, real_mul = torch._foreach_mul_, torch.Tensor.mul_

    def grads(tensors):
        return sum(t.numel() for t in tensors if t.untyped_storage().data_ptr() == ptr)

    def foreach(tensors, s):
        counted.append(grads(tensors))
        return real_foreach(tensors, s)

    def mul(t, s):
        counted.append(grads([t]))
        return real_mul(t, s)

    torch._foreach_mul_, torch.Tensor.mul_ = foreach, mul
    try:
        info = e.step(OPT["lr"])
    finally:
        torch._foreach_mul_, torch.Tensor.mul_ = real_foreach, real_mul
    res = dict(scaled=sum(counted), flat=e.layout.total_numel, norm=info.grad_norm,
               owned=sum(f.length for f in e.own))
    e.close()
    return res


def world(rank: int, world_size: int) -> dict:
    """4 ranks: tp1 x dp4 and tp2 x dp2."""
    out = {}
    for tp in (1, 2):
        grid = ProcessGrid(tp=tp)
        res = dict(exact=exactness(grid, grid.rank == 0))
        if tp == 2:
            res["param_gather"] = param_gather(grid)
            res["bf16"] = bf16_grads(grid)
            res["clip"] = clipping(grid)
        out[tp] = res
    return out
