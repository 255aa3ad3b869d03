"""World functions for ``tests/test_qgz.py`` (spawned ranks; importable): ZeRO++ qgZ's
hierarchical quantized reduce-scatter against the exact one, alone and inside the engine.

4 gloo ranks act as 2 nodes of 2 (``HYBRID_LOCAL_WORLD_SIZE=2``), and as 1 node of 4 and 4 nodes
of 1 for the one-stage cases.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybrid.parallel.grid import ProcessGrid
from hybrid.zero.comm import DPComm
from hybrid.zero.qgz import HierarchicalGroups, QuantizedReduceScatter
from hybrid.zero.quantize import qmax
from hybrid.zero.topology import NODE_SIZE_ENV, build_node_groups


def _groups(grid: ProcessGrid, local: int) -> HierarchicalGroups:
    os.environ[NODE_SIZE_ENV] = str(local)
    ng = build_node_groups(grid)
    return HierarchicalGroups(ng.intra_group, ng.inter_group, len(ng.intra_ranks),
                              len(ng.inter_ranks))


def _inputs(n: int, c: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[n c]`` input: normal values with a per-rank, per-chunk scale (so block
    maxima differ), half of chunk 1 exactly zero."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n * c, generator=g) * (1 + torch.arange(n).repeat_interleave(c) + rank)
    x[c:c + c // 2] = 0.0
    return x.to(dtype)


class _SentBytes:
    """Counts what this rank sends through ``dist.all_to_all_single``: (g - 1) / g of each input
    (g the group size), split by whether the group is the inter-node one."""

    def __init__(self, inter_group):
        self.inter_group, self.sent = inter_group, {"intra": 0, "inter": 0}
        self.real = dist.all_to_all_single

    def __call__(self, out, inp, *a, group=None, **k):
        g = dist.get_world_size(group)
        key = "inter" if group is self.inter_group else "intra"
        self.sent[key] += (g - 1) * inp.numel() * inp.element_size() // g
        return self.real(out, inp, *a, group=group, **k)


def collective_world(rank: int, world: int) -> dict:
    """Every (nodes x local, bits, chunk, dtype) case: max error, its bound, determinism, the
    async path, the bytes sent vs :meth:`wire_bytes`, and NaN propagation."""
    grid = ProcessGrid(tp=1)
    out = {"cases": {}}
    for local in (2, 4, 1):
        groups = _groups(grid, local)
        for bits in (4, 8):
            q = QuantizedReduceScatter(groups, bits)
            for c, dtype in ((1000, torch.float32), (37, torch.float32), (700, torch.bfloat16)):
                out["cases"][local, bits, c, str(dtype)] = _case(q, grid, c, dtype)
    groups = _groups(grid, 2)
    q = QuantizedReduceScatter(groups, 4)
    spy = _SentBytes(groups.inter_group)
    dist.all_to_all_single = spy
    try:
        q(torch.empty(1000), _inputs(world, 1000, torch.float32, rank))
    finally:
        dist.all_to_all_single = spy.real
    out["sent"], out["wire"] = spy.sent, q.wire_bytes(world * 1000)
    x = _inputs(world, 300, torch.float32, rank)
    if rank == 1:
        x[2 * 300 + 5] = float("inf")  # in rank 2's chunk
    y = torch.empty(300)
    q(y, x)
    out["nan"] = (int(y.isnan().sum()), bool(y.isfinite().all()))
    comm = DPComm(grid.dp_group, quantized=q)
    comm.reduce_scatter(torch.empty(1000), _inputs(world, 1000, torch.float32, rank))
    out["ledger"] = ({k: dict(v) for k, v in comm.node_bytes.items()}, dict(comm.bytes))
    return out


def _case(q: QuantizedReduceScatter, grid: ProcessGrid, c: int, dtype) -> dict:
    n, rank = grid.dp_size, grid.dp_rank
    inp = _inputs(n, c, dtype, rank)
    everyone = [torch.empty_like(inp) for _ in range(n)]
    dist.all_gather(everyone, inp, group=grid.dp_group)
    exact = torch.stack([e.double() for e in everyone]).sum(0)[rank * c:(rank + 1) * c]
    amax = sum(e.double().abs().max().item() for e in everyone)
    one_stage = q.groups.local == 1 or q.groups.nodes == 1
    bound = amax / qmax(q.bits) / (2 if one_stage else 1)
    y = torch.empty(c, dtype=dtype)
    q(y, inp)
    again = torch.empty(c, dtype=dtype)
    q(again, inp.clone(), async_op=True).wait()
    err = (y.double() - exact).abs()
    # a bf16 output rounds once more: half an ulp of the largest |sum| (2^-8 relative)
    slack = exact.abs().max().item() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6)
    return dict(err=err.max().item(), mean_err=err.mean().item(), bound=bound + slack,
                deterministic=torch.equal(y, again), scale=exact.abs().max().item())


def engine_world(rank: int, world: int, stage: int) -> dict:
    """One micro-batch's backward of the tiny GPT at ``stage`` (bf16, dp 4 as 2 nodes x 2), qgZ
    off and on from the same weights and batch: the gradient partitions, the per-bucket bound
    from the quantized inputs' maxima, and one step's ledger with bf16 gradients."""
    from hybrid.zero.config import ZeroConfig
    from tests.tiny import make_batch
    from tests.zero_worlds import build

    os.environ[NODE_SIZE_ENV] = "2"
    grid = ProcessGrid(tp=1)
    x, y = make_batch(50 + grid.dp_rank, 2, 16, 1001, motif=True)
    got, maxima = {}, []
    for qgz in (False, True):
        zc = ZeroConfig(stage=stage, precision="bf16", quantized_gradients=qgz,
                        quantized_gradients_bits=8, reduce_bucket_size=4000,
                        param_persistence_threshold=0)
        e = build(grid, zc)
        if qgz:
            call = type(e.comm.quantized).__call__

            def spy(self, out, inp, async_op=False, call=call):
                maxima.append(inp.float().abs().max().item())
                return call(self, out, inp, async_op)

            type(e.comm.quantized).__call__ = spy
        try:
            e.backward(e.model(x, y).mean(), is_last_micro_batch=True)
        finally:
            if qgz:
                type(e.comm.quantized).__call__ = call
        got[qgz] = e.reducer.buffer.float().clone()
        buckets = [(b.start, b.end) for b in e.reducer.buckets]
        e.close()
    allmax = [None] * world
    dist.all_gather_object(allmax, maxima)
    sums = [sum(col) for col in zip(*allmax, strict=True)]  # per bucket, over the ranks
    bound = torch.zeros_like(got[False])
    for (a, b), s in zip(buckets, sums, strict=True):
        bound[a:b] = s / qmax(8) / grid.dp_size
    ledger = {}
    for qgz in (False, True):
        zc = ZeroConfig(stage=stage, precision="bf16", grad_reduce_in_bf16=True,
                        quantized_gradients=qgz, reduce_bucket_size=40_000,
                        param_persistence_threshold=0)
        e = build(grid, zc)
        e.backward(e.model(x, y).mean(), is_last_micro_batch=True)
        info = e.step(1e-3)
        ledger[qgz] = (info.node_bytes, info.comm_bytes)
        e.close()
    return dict(off=got[False], on=got[True], bound=bound, ledger=ledger)


MOCK = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--seed", "5",
        "--bf16", "--zero-stage", "3"]
QGZ = ["--zero-quantized-gradients"]


def training_argvs(directory: str) -> list[list[str]]:
    """qgZ off and on for 4 iterations, then on for 2 (saved at tp 1 x dp 4) and resumed to 4
    (dropout 0.1), and the checkpoint loaded at tp 2 x dp 2 and saved again at once."""
    ck, ck2 = os.path.join(directory, "ck_qgz"), os.path.join(directory, "ck_qgz_tp2")
    return [MOCK + ["--train-iters", "4"], MOCK + QGZ + ["--train-iters", "4"],
            MOCK + QGZ + ["--train-iters", "2", "--save", ck],
            MOCK + QGZ + ["--train-iters", "4", "--load", ck],
            MOCK + QGZ + ["--tensor-model-parallel-size", "2", "--train-iters", "2", "--load", ck,
                          "--save", ck2]]


def qgz_world(rank: int, world: int, directory: str) -> dict:
    """Everything ``tests/test_qgz.py`` checks, in one spawn: the collective, the engine at
    stages 2 and 3, and the training runs of :func:`training_argvs`."""
    from tests.pretrain_worlds import run_configs

    out = dict(collective=collective_world(rank, world))
    for stage in (2, 3):
        out[f"engine{stage}"] = engine_world(rank, world, stage)
    os.environ[NODE_SIZE_ENV] = "2"
    out["training"] = run_configs(rank, world, training_argvs(directory))
    out["directory"] = directory
    return out
