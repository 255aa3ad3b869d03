"""World functions and the single-process reference for the ZeRO engine tests (importable).

Model: a 2-block GPT whose MLP width 126 gives a 63-element ``fc1.bias`` shard at tp=2 (and
units whose sizes are no multiple of dp), so partitions need padding. One optimizer step uses a
global batch of 8 sequences split over dp ranks x 2 micro-batches; the reference runs the plain
GPT on all 8 at once with torch.optim.AdamW (same two groups) and clip_grad_norm_.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.tp_plan import parallelize_gpt
from hybrid.zero.engine import OptimizerConfig, ZeroConfig, ZeroEngine
from models.gpt import GPT, GPTConfig
from tests.tiny import SEED, build_parallel, make_batch, tiny_config
from tests.tiny import reference as tiny_reference

CFG = tiny_config()
GLOBAL_BATCH, SEQ, MICRO, STEPS = 8, 16, 2, 5
# adam_eps 1e-6: the attention key bias has an exactly-zero true gradient (softmax is invariant
# to it), so its computed gradient is rounding noise (~1e-10) that Adam would blow up to
# lr * noise / (sqrt(v) + eps); a larger eps keeps that below the 1e-5 parity tolerance.
OPT = dict(lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, clip_grad=1.0)


def global_batch(step: int):
    """The learnable global batch of ``step`` (:func:`tests.tiny.make_batch` with ``motif``)."""
    return make_batch(1000 + step, GLOBAL_BATCH, SEQ, CFG["vocab_size"], motif=True)


def micro_batch(step: int, dp_rank: int, dp: int, m: int, micro: int = MICRO):
    """Sequences of data-parallel rank ``dp_rank``'s micro-batch ``m`` (a slice of the global
    batch)."""
    x, y = global_batch(step)
    per = GLOBAL_BATCH // (dp * micro)
    lo = (m * dp + dp_rank) * per
    return x[lo:lo + per], y[lo:lo + per]


def reference(steps: int = STEPS, clip: float = OPT["clip_grad"]):
    """Single-process GPT + AdamW: per-step losses, pre-clip norms, params after step 1 and at
    end."""
    r = tiny_reference(CFG, [global_batch(step) for step in range(steps)],
                       dict(OPT, clip_grad=clip))
    return {k: r[k] for k in ("losses", "norms", "first", "final")}


class CheckpointBlock(nn.Module):
    """Activation checkpointing of a whole block, as a wrapper (recompute in backward)."""

    def __init__(self, block, reentrant: bool):
        super().__init__()
        self._checkpoint_wrapped_module = block
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self._checkpoint_wrapped_module, x, use_reentrant=self.reentrant)


def build(grid: ProcessGrid, zc: ZeroConfig, opt: dict | None = None, ckpt: str | None = None):
    """:func:`tests.tiny.build_parallel`; ``ckpt`` instead wraps the TP blocks in
    ``torch.utils.checkpoint`` (a foreign checkpoint wrapper under ZeRO-3, which ``parallelize``
    deliberately does not offer), so that one case composes by hand."""
    if ckpt is None:
        return build_parallel(grid, CFG, zero=zc, optimizer=OptimizerConfig(**(opt or OPT)))
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    parallelize_gpt(model, grid.tp_group)
    for i in range(len(model.layers)):
        model.layers[i] = CheckpointBlock(model.layers[i], reentrant=ckpt == "reentrant")
    return ZeroEngine(model, grid, zc, OptimizerConfig(**(opt or OPT)))


def train(engine: ZeroEngine, grid: ProcessGrid, steps: int = STEPS, inject=None,
          micro: int = MICRO) -> dict:
    """Run ``steps`` optimizer steps; returns losses, infos, and full params after step 1 / end.

    ``inject(step, m)`` may return a tensor hook to register for that micro-batch's backward.
    """
    losses, infos, first = [], [], None
    dp = grid.dp_size
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            x, y = (t.to(grid.device) for t in micro_batch(step, grid.dp_rank, dp, m, micro))
            loss = engine.model(x, y).mean() / micro
            handle = inject(step, m) if inject else None
            engine.backward(loss, is_last_micro_batch=(m == micro - 1))
            if handle is not None:
                handle.remove()
            total += loss.item()
        t = torch.tensor([total], dtype=torch.float64, device=grid.device)  # NCCL: on the GPU
        dist.all_reduce(t, group=grid.dp_group)
        losses.append(t.item() / dp)
        info = engine.step(OPT["lr"])
        infos.append(dict(skipped=info.skipped, grad_norm=info.grad_norm,
                          loss_scale=info.loss_scale, comm=info.comm_bytes))
        if step == 0:
            first = engine.model_state_dict_full()
    return dict(losses=losses, infos=infos, first=first, final=engine.model_state_dict_full())


# ---- checks run inside the spawned worlds -----------------------------------------------------
LAYER_NUMEL = 33_000  # elements of one block at tp=1 (about 16.6k at tp=2)
VARIANTS = {
    "default": dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                    param_persistence_threshold=100),
    "no_overlap": dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                       param_persistence_threshold=100, overlap_comm=False),
    "small_buckets": dict(reduce_bucket_size=3_000, allgather_bucket_size=3_000,
                          param_persistence_threshold=0),
    "huge_buckets": dict(reduce_bucket_size=10**9, allgather_bucket_size=10**9,
                         param_persistence_threshold=0),
    "all_reduce": dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                       param_persistence_threshold=100, grad_reduce="all_reduce"),
    # gloo's native reduce-scatter / all-gather (what NCCL runs) instead of the composed ones
    "native_collectives": dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                               param_persistence_threshold=100, comm=dict(composed=False)),
    # today's path before issue 33 (the default is gradient-accumulation fusion)
    "no_fusion": dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                      param_persistence_threshold=100, gradient_accumulation_fusion=False),
    # the updated parameters' all-gathers left in flight, waited by the forward (stages 1-3)
    "overlap_param_gather": dict(reduce_bucket_size=3_000, allgather_bucket_size=3_000,
                                 param_persistence_threshold=100, overlap_param_gather=True),
    # every all-gather composed from broadcasts (the tiny model's are below the size that is)
    "broadcast_gathers": dict(reduce_bucket_size=3_000, allgather_bucket_size=3_000,
                              param_persistence_threshold=100, comm=dict(broadcast_min_numel=0)),
}


DP_ONLY = ("no_overlap", "small_buckets", "huge_buckets", "all_reduce", "native_collectives",
           "broadcast_gathers")
"""Variants that change only the data-parallel collectives (buckets, reduce op, composition):
run on tp1 x dp4, the widest data-parallel group, and not again on tp2 x dp2 (every pair of
grid and ZeRO option is also in ``tests/test_combinations.py``)."""


def _parity(grid, rank0: bool) -> dict:
    out = {}
    for stage in range(4):
        for name, kw in VARIANTS.items():
            if stage == 0 and kw.get("overlap_param_gather"):
                continue  # refused: stage 0 gathers no parameters
            if grid.tp_size > 1 and name in DP_ONLY:
                continue
            kw = dict(kw)
            comm = kw.pop("comm", {})
            engine = build(grid, ZeroConfig(stage=stage, **kw))
            vars(engine.comm).update(comm)
            r = train(engine, grid)
            out[(stage, name)] = r if rank0 else None
    return out


def _checkpointed(grid, rank0: bool) -> dict:
    out = {}
    for mode in ("non_reentrant", "reentrant"):
        zc = ZeroConfig(stage=3, param_persistence_threshold=0, reduce_bucket_size=20_000,
                        allgather_bucket_size=20_000)
        e = build(grid, zc, ckpt=mode)
        r = train(e, grid)
        r["gathered_peak"] = e.memory_bytes()["gathered_peak"]
        out[mode] = r if rank0 else None
    return out


def _comm(grid) -> dict:
    out = {}
    for stage in range(4):
        e = build(grid, ZeroConfig(stage=stage, param_persistence_threshold=0,
                                   reduce_bucket_size=20_000, allgather_bucket_size=20_000))
        r = train(e, grid, steps=2, micro=1)
        out[stage] = dict(comm=r["infos"][1]["comm"], psi=e.layout.numel,
                          padded=e.layout.total_numel, dp=grid.dp_size)
    return out


def _memory(grid) -> dict:
    out = {}
    for stage in range(4):
        e = build(grid, ZeroConfig(stage=stage, precision="bf16", param_persistence_threshold=0))
        train(e, grid, steps=1)
        out[stage] = dict(mem=e.memory_bytes(), psi=e.layout.numel, padded=e.layout.total_numel,
                          dp=grid.dp_size, summary=e.summary())
    return out


def _snapshot(engine) -> list[torch.Tensor]:
    """Master weights, Adam moments and every parameter storage the rank holds (stage 3: its
    shard and the persistent parameters; released units have no storage to compare)."""
    held = [p.detach().clone() for p in engine.params if p.untyped_storage().nbytes() > 0]
    st = engine.states
    extra = [] if st.param_shard is None else [st.param_shard.clone()]
    return held + extra + [st.master.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone()]


def _fp16(grid) -> dict:
    """Inject an inf into one rank's gradient at step 3 (index 2); record what every rank saw."""
    cases = {"tp_rank_1_only": (1, "ln_f.weight"), "dp_rank_1_only": (2, "layers.0.mlp.fc1.weight")}
    out = {}
    for case, (target, pname) in cases.items():
        for stage in range(4):
            e = build(grid, ZeroConfig(stage=stage, precision="fp16", hysteresis=1,
                                       initial_loss_scale=2.0**12, param_persistence_threshold=100,
                                       reduce_bucket_size=20_000, allgather_bucket_size=20_000))
            param = dict(e.model.named_parameters())[pname]
            steps, unchanged, changed4 = [], None, None
            for step in range(4):
                for m in range(MICRO):
                    x, y = micro_batch(step, grid.dp_rank, grid.dp_size, m)
                    loss = e.model(x, y).mean() / MICRO
                    h = None
                    if step == 2 and m == MICRO - 1 and grid.rank == target:
                        h = param.register_hook(lambda g: g.clone().view(-1).index_fill_(
                            0, torch.tensor([3]), float("inf")).view_as(g))
                    e.backward(loss, is_last_micro_batch=(m == MICRO - 1))
                    if h is not None:
                        h.remove()
                before = _snapshot(e)
                info = e.step(OPT["lr"])
                after = _snapshot(e)
                same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                if step == 2:
                    unchanged = same
                if step == 3:
                    changed4 = not same
                steps.append(dict(skipped=info.skipped, scale=info.loss_scale,
                                  norm=info.grad_norm, loss=loss.item()))
            out[(case, stage)] = dict(steps=steps, unchanged=unchanged, changed4=changed4,
                                      skipped_steps=e.skipped_steps, injected=grid.rank == target)
    return out


def _bf16(grid) -> dict:
    out = {}
    for stage in (1, 3):
        res = {}
        for prec in ("fp32", "bf16"):
            e = build(grid, ZeroConfig(stage=stage, precision=prec, param_persistence_threshold=100,
                                       reduce_bucket_size=20_000, allgather_bucket_size=20_000))
            r = train(e, grid, steps=20)
            res[prec] = dict(losses=r["losses"], grad_dtype=e.reducer.buffer.dtype,
                             master_dtype=e.states.master.dtype, param_dtype=e.params[0].dtype)
        out[stage] = res
    return out


def _export(grid, rank0: bool) -> dict:
    """Stage-3 engine trains 5 steps, exports; a stage-1 engine imports and both step once more."""
    kw = dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
              param_persistence_threshold=100)
    a = build(grid, ZeroConfig(stage=3, **kw))
    train(a, grid)
    state = a.optimizer_state_by_name()
    b = build(grid, ZeroConfig(stage=1, **kw))
    b.load_optimizer_state_by_name(state)
    state_b = b.optimizer_state_by_name()
    roundtrip = all(torch.equal(state[n][k], state_b[n][k]) for n in state for k in state[n])
    ra = train(a, grid, steps=1)
    rb = train(b, grid, steps=1)
    diff = max((ra["final"][k] - rb["final"][k]).abs().max().item() for k in ra["final"])
    x, y = micro_batch(7, grid.dp_rank, grid.dp_size, 0)
    with torch.no_grad():  # evaluation forward at stage 3 (gathers, then releases every block)
        eval_a = a.eval().model(x, y).mean().item()
        eval_b = b.eval().model(x, y).mean().item()
    released = all(buf.untyped_storage().nbytes() == 0
                   for u, buf in zip(a.layout.units, a.states.unit_bufs, strict=True)
                   if not u.persistent)
    a.train()
    x2, y2 = micro_batch(8, grid.dp_rank, grid.dp_size, 0)
    a.backward(a.model(x2, y2).mean(), is_last_micro_batch=True)  # training resumes after eval
    train_after_eval = not a.step(OPT["lr"]).skipped
    local_shapes = {n: tuple(p.shape) for n, p in a.model.named_parameters()}
    return dict(state=state if rank0 or grid.tp_rank == 1 else None, roundtrip=roundtrip,
                continue_diff=diff, shapes=local_shapes, eval=(eval_a, eval_b), released=released,
                train_after_eval=train_after_eval, tp_rank=grid.tp_rank, dp_rank=grid.dp_rank)


def world4(rank: int, world: int) -> dict:
    """Every check that needs 4 ranks: grids tp1 x dp4 and tp2 x dp2."""
    out = {}
    for tp in (1, 2):
        grid = ProcessGrid(tp=tp)
        r0 = grid.rank == 0
        res = dict(parity=_parity(grid, r0), ckpt=_checkpointed(grid, r0), comm=_comm(grid))
        if tp == 1:
            res["memory"] = _memory(grid)
        else:
            res["fp16"] = _fp16(grid)
            res["bf16"] = _bf16(grid)
            res["export"] = _export(grid, r0)
        out[tp] = res
    return out


def world2(rank: int, world: int) -> dict:
    grid = ProcessGrid(tp=1)
    return dict(parity=_parity(grid, grid.rank == 0))


def world_gpu(rank: int, world: int) -> dict:
    """Every stage on one CUDA device (dp = 1): fp32 parity, bf16 runs, stage-3 storage release."""
    grid = ProcessGrid(tp=1)
    out = {}
    for stage in range(4):
        kw = dict(stage=stage, param_persistence_threshold=100, reduce_bucket_size=20_000,
                  allgather_bucket_size=20_000)
        e = build(grid, ZeroConfig(**kw))
        r = train(e, grid)
        out[stage] = dict(losses=r["losses"], final={k: v.cpu() for k, v in r["final"].items()},
                          device=str(e.states.master.device))
        b = build(grid, ZeroConfig(precision="bf16", **kw))
        out[(stage, "bf16")] = train(b, grid, steps=3)["losses"]
    return out


def comm_world(rank: int, world: int) -> dict:
    """Composed gloo collectives (``DPComm.composed``) against gloo's native ones on random data:
    reduce-scatter (sync, async, with and without scratch) and all-gather (flat and into a list),
    plus which torch.distributed collectives each path called."""
    import contextlib
    from unittest import mock

    from hybrid.zero.comm import DPComm
    comm = DPComm(None)
    comm.broadcast_min_numel = 0
    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * 1000, generator=g)
    shard = torch.randn(777, generator=g)
    out = {}
    calls: list[str] = []

    def counting(name):
        real = getattr(dist, name)

        def call(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return mock.patch.object(dist, name, side_effect=call)

    for composed in (False, True):
        comm.composed = composed
        with contextlib.ExitStack() as patched:
            for n in ("all_to_all_single", "broadcast"):
                patched.enter_context(counting(n))
            rs_sync, rs_async = torch.empty(1000), torch.empty(1000)
            comm.reduce_scatter(rs_sync, inp)
            comm.reduce_scatter(rs_async, inp, async_op=True,
                                scratch=torch.empty(world * 1000 + 5)).wait()
            ag_flat = torch.empty(world * 777)
            comm.all_gather(ag_flat, shard)
            ag_list = [torch.empty(777) for _ in range(world)]
            comm.all_gather(ag_list, shard, async_op=True).wait()
        out[composed] = dict(rs_sync=rs_sync, rs_async=rs_async, ag_flat=ag_flat,
                             ag_list=torch.cat(ag_list), calls=sorted(set(calls)))
        calls.clear()
    return out


def offload_world(rank: int, world: int) -> dict:
    """``--optimizer-cpu-offload`` against the device optimizer on tp1 x dp2, 3 steps each:
    bf16 with bf16 gradients (ZeRO-2), fp16 whose dynamic scale overflows every step (ZeRO-1,
    the skip path), and 30% offloaded (ZeRO-3, bf16). Returns per case whether the losses are
    equal, the largest final parameter difference, the skipped flags of both, and the split."""
    out = {}
    cases = {"z2_bf16_grads": (2, dict(precision="bf16", grad_reduce_in_bf16=True)),
             "z1_fp16_skips": (1, dict(precision="fp16")),
             "z3_fraction_0.3": (3, dict(precision="bf16", optimizer_offload_fraction=0.3))}
    grid = ProcessGrid(tp=1)
    for name, (stage, extra) in cases.items():
        kw = dict(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000,
                  param_persistence_threshold=100, **extra)
        a = train(build(grid, ZeroConfig(**kw)), grid, steps=3)
        e = build(grid, ZeroConfig(optimizer_cpu_offload=True, **kw))
        b = train(e, grid, steps=3)
        out[name] = dict(
            losses_equal=a["losses"] == b["losses"],
            diff=max((a["final"][k] - b["final"][k]).abs().max().item() for k in a["final"]),
            skipped=([i["skipped"] for i in a["infos"]], [i["skipped"] for i in b["infos"]]),
            split=(e.host_split, e.layout.partition_numel), host=e.memory_bytes()["host_states"])
        e.close()
    return out
