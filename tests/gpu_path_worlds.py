"""World functions for ``tests/test_gpu_path.py`` (importable by spawned ranks)."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from hybrid.parallel.grid import ProcessGrid
from hybrid.zero.config import ZeroConfig


def list_gathers_by_broadcast(rank: int, world: int) -> dict:
    """ZeRO-3 with chunked unit gathers (small all-gather buckets) and the chunked refresh, its
    list all-gathers as NCCL runs them now (one broadcast per rank into its slot) against gloo's
    native list all-gather: the same training run, and which collectives ran."""
    from tests.zero_worlds import build, train

    grid = ProcessGrid(tp=1)
    out = {}
    for by_broadcast in (False, True):
        torch.manual_seed(0)
        e = build(grid, ZeroConfig(stage=3, reduce_bucket_size=3_000, allgather_bucket_size=3_000,
                                   param_persistence_threshold=100))
        e.comm.composed = False  # gloo's native collectives, as NCCL runs them
        e.comm.list_gather_by_broadcast = by_broadcast
        calls = {"all_gather": 0, "broadcast": 0}

        def counting(name, calls=calls):
            real = getattr(dist, name)

            def call(*a, **k):
                calls[name] += 1
                return real(*a, **k)
            return mock.patch.object(dist, name, side_effect=call)

        with counting("all_gather"), counting("broadcast"):
            r = train(e, grid, steps=2)
        out[by_broadcast] = dict(losses=r["losses"], final=r["final"], calls=calls)
    return out
