"""The parameter refresh after a ZeRO optimizer step: the updated fp32 master partition back into
the compute-dtype parameters every rank uses (ZeRO paper §5.1/§5.2: the all-gather of the updated
parameters, Psi per step; stage 0 only copies)."""

from __future__ import annotations

import torch


@torch.no_grad()
def refresh_params(engine) -> None:
    """Copy the updated fp32 master into the compute-dtype parameters (stage 1/2 and stage-3
    persistent units: all-gather of every rank's shard). Gathers read the master itself
    (fp32 training) or the stage-3 compute-dtype shard and are all issued before the first
    wait; only 16-bit stage 1/2 converts chunk by chunk through one staging buffer.

    Args:
        engine: a :class:`hybrid.zero.engine.ZeroEngine` (its layout, master, parameter buffers
            and data-parallel comm); collective over its data-parallel group.
    """
    L = engine.layout
    if engine.stage == 0:
        engine.param_flat.copy_(engine.master)
        return
    if engine.stage == 3:
        engine.param_shard.copy_(engine.master)
    source = engine.param_shard if engine.stage == 3 else (
        engine.master if engine.dtype == engine.master.dtype else None)
    works = []
    for u in L.units:
        if engine.stage == 3 and not u.persistent:
            continue
        buf = engine.unit_bufs[u.index]
        for lo, hi in L.unit_chunks(u.index, engine.ag_chunk):
            span = slice(u.part_offset + lo, u.part_offset + hi)
            if source is None:
                inp = engine._ag_staging[:hi - lo]
                inp.copy_(engine.master[span])
            out = buf if (lo, hi) == (0, u.shard) else [
                buf[r * u.shard + lo:r * u.shard + hi] for r in range(engine.dp)]
            if source is None:
                engine.comm.all_gather(out, inp).wait()
            else:
                works.append(engine.comm.all_gather(out, source[span], async_op=True))
    for w in works:
        w.wait()
