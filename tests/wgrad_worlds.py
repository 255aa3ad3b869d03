"""World functions for the fused weight-gradient GEMM (issue 41 item 3,
hybrid.parallel.linear.gemm):
bf16 training with ``--gradient-accumulation-fusion`` on and off over the paths that compute a
weight gradient (the column/row-parallel functions, the SwiGLU pair, sequence parallelism and
its rings, tp 1's plain linears, the tied and untied output layer), with micro-batch
accumulation and both reduction schedules, and what the hook and the buffer saw.
"""

from __future__ import annotations

from hybrid.parallel.grid import ProcessGrid
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from tests.tiny import build_parallel, tiny_config
from tests.zero_worlds import OPT, train

BASE = dict(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
            param_persistence_threshold=100)
LLAMA = tiny_config(swiglu=True, untie_embeddings_and_output_weights=True,
                    normalization="RMSNorm", add_bias_linear=False, num_query_groups=2,
                    position_embedding_type="rope")
CASES = {
    # name: (model, zero overrides, sequence_parallel, tp_comm_overlap)
    "stage0": (tiny_config(), dict(stage=0), False, False),
    "stage1": (tiny_config(), dict(stage=1), False, False),
    "stage1_no_overlap": (tiny_config(), dict(stage=1, overlap_comm=False), False, False),
    "stage2": (tiny_config(), dict(stage=2), False, False),
    "stage3": (tiny_config(), dict(stage=3), False, False),
    "llama_stage1": (LLAMA, dict(stage=1), False, False),
    "llama_stage1_sp": (LLAMA, dict(stage=1), True, False),
    "llama_stage0_sp_ring": (LLAMA, dict(stage=0), True, True),
}
"""Each runs bf16 with fusion on and off (same weights, data and order)."""


def run(grid: ProcessGrid, model: dict, zero: dict, sp: bool, ring: bool, fusion: bool,
        precision: str = "bf16", steps: int = 10) -> dict:
    zc = ZeroConfig(precision=precision, gradient_accumulation_fusion=fusion, **dict(BASE, **zero))
    e = build_parallel(grid, model, zero=zc, optimizer=OptimizerConfig(**OPT),
                       sequence_parallel=sp, tp_comm_overlap=ring)
    fused = {n for n, p in e.model.named_parameters() if hasattr(p, "main_grad")}
    r = train(e, grid, steps=steps)
    e.close()
    left = sorted(n for n, p in e.model.named_parameters() if hasattr(p, "main_grad"))
    return dict(losses=r["losses"], norms=[i["grad_norm"] for i in r["infos"]],
                final=r["final"], fused=sorted(fused), left_after_close=left)


def first_gradients(grid: ProcessGrid, case: str, fusion: bool) -> dict:
    """The fp32 buffer after one step's two micro-batches (stage 0: every rank holds all of
    it), per parameter: ``{name: tensor}``."""
    from tests.zero_worlds import micro_batch

    model, zero, sp, ring = CASES[case]
    zc = ZeroConfig(precision="bf16", gradient_accumulation_fusion=fusion,
                    **dict(BASE, **dict(zero, stage=0)))
    e = build_parallel(grid, model, zero=zc, optimizer=OptimizerConfig(**OPT),
                       sequence_parallel=sp, tp_comm_overlap=ring)
    for m in range(2):
        x, y = (t.to(grid.device) for t in micro_batch(0, grid.dp_rank, grid.dp_size, m))
        e.backward(e.model(x, y).mean() / 2, is_last_micro_batch=m == 1)
    out = {s.name: e.reducer.grad_flat[s.offset:s.offset + s.numel].clone()
           for s in e.layout.slots}
    e.close()
    return out


def world(rank: int, world_size: int) -> dict:
    """4 ranks: at tp 2 x dp 2 every case of :data:`CASES` with fusion on and off, fp32 at stage
    1 both ways, the buffer against the exact gradient and the first gradients of the tied GPT
    and the untied SwiGLU model on the SP rings; at tp 1 x dp 4 the stage-1 cases."""
    out = {}
    for tp in (2, 1):
        grid, res = ProcessGrid(tp=tp), {}
        for name, (model, zero, sp, ring) in CASES.items():
            if tp == 1 and (sp or ring or zero["stage"] != 1):
                continue
            res[name] = {f: run(grid, model, zero, sp, ring, f) for f in (True, False)}
        if tp == 2:
            res["fp32_stage1"] = {f: run(grid, tiny_config(), dict(stage=1), False, False, f,
                                         "fp32", 5) for f in (True, False)}
            res["exact"] = {f: buffer_vs_exact(grid, f) for f in (True, False)}
            res["first"] = {c: {f: first_gradients(grid, c, f) for f in (True, False)}
                            for c in ("stage0", "llama_stage0_sp_ring")}
        out[tp] = res
    return out


def buffer_vs_exact(grid: ProcessGrid, fusion: bool) -> dict:
    """Stage 0, bf16, tied GPT, two micro-batches: each block linear's weight gradient in the
    engine's fp32 buffer against ``mean over dp of sum over micro-batches of dy^T x`` in fp64,
    from the 16-bit ``x`` and ``dy`` the layer saw: ``{name: (max |error|, max |exact|)}``."""
    import torch.distributed as dist

    from hybrid.parallel.linear.modules import ColumnParallelLinear, RowParallelLinear
    from tests.zero_worlds import micro_batch

    zc = ZeroConfig(precision="bf16", gradient_accumulation_fusion=fusion, stage=0, **BASE)
    e = build_parallel(grid, tiny_config(), zero=zc, optimizer=OptimizerConfig(**OPT))
    exact, handles = {}, []

    def capture(name):
        def hook(module, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()

            def grad_hook(dy):
                g = dy.reshape(-1, dy.shape[-1]).double()
                exact[name] = exact.get(name, 0) + g.t() @ x
            out.register_hook(grad_hook)
        return hook

    for name, m in e.model.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            handles.append(m.register_forward_hook(capture(name + ".weight")))
    for m in range(2):
        x, y = (t.to(grid.device) for t in micro_batch(0, grid.dp_rank, grid.dp_size, m))
        e.backward(e.model(x, y).mean() / 2, is_last_micro_batch=m == 1)
    slots = {s.name: s for s in e.layout.slots}
    out = {}
    for name, want in sorted(exact.items()):
        dist.all_reduce(want, group=grid.dp_group)
        want /= grid.dp_size
        s = slots[name]
        got = e.reducer.grad_flat[s.offset:s.offset + s.numel].view(s.shape).double()
        out[name] = ((got - want).abs().max().item(), want.abs().max().item())
    for h in handles:
        h.remove()
    e.close()
    return out


def gpu_world(rank: int, world_size: int) -> dict:
    """One CUDA rank: stage 1 bf16 at tp 1, how many parameters got a main grad, the buffer
    against the exact gradient, two steps' losses."""
    grid = ProcessGrid(tp=1)
    zc = ZeroConfig(stage=1, precision="bf16", **BASE)
    e = build_parallel(grid, tiny_config(), zero=zc, optimizer=OptimizerConfig(**OPT))
    fused, params = len(e.reducer.wgrad_fused), len(e.params)
    r = train(e, grid, steps=2)
    e.close()
    return dict(fused=fused, params=params, losses=r["losses"], exact=buffer_vs_exact(grid, True))
