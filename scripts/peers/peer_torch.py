"""Plain-PyTorch peers of ``scripts/bench_zero.py`` on the common workload (``workload.py``).

    torchrun --standalone --nproc-per-node N scripts/peers/peer_torch.py MODE

MODE:
- ``ddp``: ``DistributedDataParallel`` (every rank holds everything; gradients all-reduced).
- ``fsdp2``: ``fully_shard`` per block and at the root (parameters, gradients and optimizer
  states sharded; parameters re-gathered for backward: the ZeRO-3 counterpart).
- ``fsdp2_noreshard``: the same with ``reshard_after_forward=False`` (the ZeRO-2 counterpart).
- ``tp2d``: DTensor tensor parallelism (``parallelize_module`` with column-wise q/k/v/fc1 and
  row-wise output/fc2) over the ``tp`` dimension of a ``(dp, tp)`` DeviceMesh, then
  ``fully_shard`` over ``dp`` (PEER_TP ranks per tensor-parallel group, default 2).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as W  # noqa: E402

MODES = ("ddp", "fsdp2", "fsdp2_noreshard", "tp2d")


def parallelize(mode: str, model, world: int, tp: int = 2):
    """Wrap ``model`` (a :class:`workload.PeerGPT`) for ``mode``; returns ``(model, dp size,
    dp rank)``. Raises ValueError for an unknown mode or a ``tp`` that does not divide
    ``world``."""
    rank = dist.get_rank()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), world, rank
    if mode in ("fsdp2", "fsdp2_noreshard"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=mode == "fsdp2")
        fully_shard(model, reshard_after_forward=mode == "fsdp2")
        return model, world, rank
    if mode != "tp2d":
        raise ValueError(f"peer mode {mode!r}; valid: {', '.join(MODES)}")
    if world % tp:
        raise ValueError(f"PEER_TP={tp} does not divide the world size {world}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"attn.wq": col, "attn.wk": col, "attn.wv": col, "attn.wo": row,
            "mlp.fc1": col, "mlp.fc2": row}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # embeddings, final norm and head: dp-sharded only
    return model, world // tp, mesh["dp"].get_local_rank()


def run(mode: str) -> dict:
    """One launch of ``mode`` in an initialised process group: trains PEER_STEPS steps and
    returns what :func:`workload.report` needs (rank 0 prints it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, c = W.cfg_from_env()
    steps, warmup = W.steps_from_env()
    model, dp, dp_rank = parallelize(mode, W.build_model(c), world,
                                     int(os.environ.get("PEER_TP", "2")))
    opt = W.make_adamw(model.parameters())
    dist.barrier()
    t_init = time.time() - W.T_PROC_START
    state = {}

    def step(x, y, i):
        loss = W.loss_fn(model(x), y)
        loss.backward()
        if i == steps - 1:  # gradients and optimizer states all live
            state["bytes"] = W.tensor_bytes([model, opt])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = W.train(step, c, dp_rank)
    # tensor-parallel replicas hold equal losses, so the world mean is the data-parallel mean
    return dict(name=mode, rank=rank, world=world, dp=dp, c=c, times=times, warmup=warmup,
                losses=W.world_mean(losses), t_init=t_init, state_bytes=state.get("bytes"))


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: peer_torch.py MODE (one of {', '.join(MODES)})")
    W.init_dist()
    W.report(**run(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
