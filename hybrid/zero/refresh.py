"""The parameter refresh after a ZeRO optimizer step: the updated fp32 master partition back into
the compute-dtype parameters every rank uses (ZeRO paper §5.1/§5.2: the all-gather of the updated
parameters, Psi per step; stage 0 only copies).

With ``--overlap-param-gather`` (Megatron-LM's meaning) the all-gathers are launched after the
step and left in flight: :class:`DeferredGathers` holds each unit's work handles and waits for
them in the next forward's pre-hooks, unit by unit (the model's hook: the ``persistent`` and
``root`` units; block ``i``'s hook: ``layers.{i}``), so the gather of block ``i + 1`` overlaps
the forward of block ``i``. Anything else that reads the parameters first calls
:meth:`DeferredGathers.wait_all` (the engine does so before backward, step, state export and
checkpointing).
"""

from __future__ import annotations

import torch

from hybrid.zero.comm import DPComm
from hybrid.zero.layout import PERSISTENT, ROOT, PartitionLayout
from hybrid.zero.offload import SplitFlat
from hybrid.zero.profile import NULL_TIMER
from hybrid.zero.stage import StagePlan
from hybrid.zero.storage import FlatStates


class DeferredGathers:
    """In-flight parameter all-gathers per layout unit, waited by forward pre-hooks.

    Args:
        model: the model (``model.layers[i]`` are the blocks).
        layout: the partition layout (unit names ``persistent``, ``root``, ``layers.{i}``).
    """

    timer = NULL_TIMER
    """A :class:`hybrid.zero.profile.PhaseTimer` while profiling (waits count as refresh)."""

    def __init__(self, model, layout: PartitionLayout):
        self.works: list[list] = [[] for _ in layout.units]
        index = {u.name: u.index for u in layout.units}
        first = [index[n] for n in (PERSISTENT, ROOT) if n in index]
        self.handles = [model.register_forward_pre_hook(self._waiter(first))]
        for i, block in enumerate(getattr(model, "layers", [])):
            if f"layers.{i}" in index:
                self.handles.append(
                    block.register_forward_pre_hook(self._waiter([index[f"layers.{i}"]])))

    def _waiter(self, units: list[int]):
        def hook(module, args):
            for u in units:
                self.wait(u)

        return hook

    def wait(self, u: int) -> None:
        """Wait for unit ``u``'s gathers (nothing when none is in flight)."""
        if self.works[u]:
            with self.timer.phase("refresh"):
                for w in self.works[u]:
                    w.wait()
                self.works[u].clear()

    def wait_all(self) -> None:
        for u in range(len(self.works)):
            self.wait(u)

    @property
    def in_flight(self) -> int:
        """Units whose gathers have not been waited for."""
        return sum(1 for w in self.works if w)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def refresh_params(states: FlatStates, layout: PartitionLayout, plan: StagePlan, comm: DPComm,
                   chunk: int, staging: torch.Tensor | None,
                   deferred: DeferredGathers | None = None) -> None:
    """Copy the updated fp32 master into the compute-dtype parameters (stage 1/2 and stage-3
    persistent units: all-gather of every rank's shard). Gathers read the master itself
    (fp32 training) or the stage-3 compute-dtype shard and are all issued before the first
    wait; 16-bit stage 1/2 converts chunk by chunk through one staging buffer, or, with
    ``deferred``, into the rank's own shard of the unit buffer, gathered from there in place.

    Args:
        states: the engine's buffers (``master`` is read, the parameter buffers written).
        layout: their partition layout.
        plan: what the stage partitions.
        comm: the data-parallel collectives (this is collective over its group).
        chunk: elements per rank per all-gather (``allgather_bucket_size // dp``).
        staging: compute-dtype ``[>= min(chunk, partition_numel)]`` buffer for 16-bit stage
            1/2 (None at stage 0).
        deferred: leave the gathers in flight, recorded there per unit (None: wait here).
    """
    L, master = layout, states.master
    if not plan.shards_optimizer_states:
        states.param_flat.copy_(master)
        return
    # offloaded: [0, split) of the master is host memory
    split = master.split if isinstance(master, SplitFlat) else 0
    if plan.shards_parameters:
        if split:
            master.copy_to(states.param_shard)
        else:
            states.param_shard.copy_(master)
        source = states.param_shard
    else:
        source = master if states.param_flat.dtype == master.dtype else None
    works = []
    for u in L.units:
        if plan.shards_parameters and not u.persistent:
            continue
        buf, mine = states.unit_bufs[u.index], comm.rank * u.shard
        pending = works if deferred is None else deferred.works[u.index]
        # a host unit is copied host->device (asynchronously from pinned memory) first
        src = None if source is master and u.part_offset < split else source
        for lo, hi in L.unit_chunks(u.index, chunk):
            span = slice(u.part_offset + lo, u.part_offset + hi)
            out = buf if (lo, hi) == (0, u.shard) else [
                buf[r * u.shard + lo:r * u.shard + hi] for r in range(comm.size)]
            if src is not None:
                pending.append(comm.all_gather(out, src[span], async_op=True))
            elif deferred is not None:  # in place: no staging buffer held across the forward
                own = buf[mine + lo:mine + hi]
                own.copy_(master[span], non_blocking=True)
                pending.append(comm.all_gather(out, own, async_op=True))
            else:
                inp = staging[:hi - lo]
                inp.copy_(master[span], non_blocking=True)
                comm.all_gather(out, inp).wait()
    for w in works:
        w.wait()
