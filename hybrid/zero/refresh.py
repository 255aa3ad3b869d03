"""The parameter refresh after a ZeRO optimizer step: the updated fp32 master partition back into
the compute-dtype parameters every rank uses (ZeRO paper §5.1/§5.2: the all-gather of the updated
parameters, Psi per step; stage 0 only copies)."""

from __future__ import annotations

import torch

from hybrid.zero.comm import DPComm
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.stage import StagePlan
from hybrid.zero.storage import FlatStates


@torch.no_grad()
def refresh_params(states: FlatStates, layout: PartitionLayout, plan: StagePlan, comm: DPComm,
                   chunk: int, staging: torch.Tensor | None) -> None:
    """Copy the updated fp32 master into the compute-dtype parameters (stage 1/2 and stage-3
    persistent units: all-gather of every rank's shard). Gathers read the master itself
    (fp32 training) or the stage-3 compute-dtype shard and are all issued before the first
    wait; only 16-bit stage 1/2 converts chunk by chunk through one staging buffer.

    Args:
        states: the engine's buffers (``master`` is read, the parameter buffers written).
        layout: their partition layout.
        plan: what the stage partitions.
        comm: the data-parallel collectives (this is collective over its group).
        chunk: elements per rank per all-gather (``allgather_bucket_size // dp``).
        staging: compute-dtype ``[>= min(chunk, partition_numel)]`` buffer for 16-bit stage
            1/2 (None at stage 0).
    """
    L = layout
    if not plan.shards_optimizer_states:
        states.param_flat.copy_(states.master)
        return
    if plan.shards_parameters:
        states.param_shard.copy_(states.master)
        source = states.param_shard
    else:
        source = states.master if states.param_flat.dtype == states.master.dtype else None
    works = []
    for u in L.units:
        if plan.shards_parameters and not u.persistent:
            continue
        buf = states.unit_bufs[u.index]
        for lo, hi in L.unit_chunks(u.index, chunk):
            span = slice(u.part_offset + lo, u.part_offset + hi)
            if source is None:
                inp = staging[:hi - lo]
                inp.copy_(states.master[span])
            out = buf if (lo, hi) == (0, u.shard) else [
                buf[r * u.shard + lo:r * u.shard + hi] for r in range(comm.size)]
            if source is None:
                comm.all_gather(out, inp).wait()
            else:
                works.append(comm.all_gather(out, source[span], async_op=True))
    for w in works:
        w.wait()
