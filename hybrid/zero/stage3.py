"""ZeRO stage 3: parameters partitioned over data parallelism, gathered per unit when used.

Each non-persistent unit (a transformer block ``model.layers[i]``, or the ``root`` unit with the
embeddings, final norm and untied head) owns one flat buffer in the compute dtype; the unit's
parameters are views into it. *Releasing* a unit frees the buffer's storage (resized to 0
bytes); *gathering* re-allocates it and all-gathers every rank's shard into it. Autograd's saved
references to the parameters (e.g. a Linear's weight) point at the same storage, so they are
valid again once the unit is re-gathered before its backward.

Schedule (static, by unit, never by data, so every rank issues the same collectives in the same
order; arXiv 1910.02054 §5.3 and §7.2.2):

- forward: the model's pre-hook gathers ``root`` and prefetches block 0; block i's pre-hook
  waits for block i, prefetches block i+1; its post-hook releases block i and registers a hook
  on the block output's gradient; the model's post-hook releases ``root`` likewise;
- backward: the gradient hook of the model output gathers ``root`` and prefetches the last
  block; the gradient hook of block i's output (fired just before block i's backward) waits for
  block i and prefetches block i-1; a unit is released once all its parameters' gradients have
  accumulated (``release``, called by the gradient reducer); leftovers after backward.
- activation-checkpoint recompute (the block's forward re-run inside backward) finds the block
  already gathered by its gradient hook; while the engine is in backward, forward hooks neither
  prefetch nor release. A block re-run without that hook (reentrant checkpointing) is gathered
  synchronously by its pre-hook.

Every parameter is thus gathered once in forward and once in backward: 3 Psi of data-parallel
traffic per step with the gradient reduce-scatter (ZeRO §7.2.2). ``root`` stays gathered from
the start of backward until its last gradient (the tied embedding's) arrives.

ZeRO++ (arXiv 2306.10209): with a ``secondary`` partition (hpZ, :mod:`hybrid.zero.hpz`) the
backward gathers come from inside the node; with ``quantized`` (qwZ, :mod:`hybrid.zero.qwz`)
the gathers from the primary partition move blockwise int8 (both are off by default).
"""

from __future__ import annotations

import functools

import torch

from hybrid.zero.comm import DPComm
from hybrid.zero.layout import ROOT, PartitionLayout
from hybrid.zero.profile import NULL_TIMER
from hybrid.zero.qwz import quantized_all_gather

RELEASED, GATHERING, GATHERED = "released", "gathering", "gathered"


def _first_grad_tensor(out):
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return None


class ParamGatherer:
    """Args:
        model: the model (``model.layers[i]`` are the blocks).
        layout: the partition layout (``persistent`` units are never released).
        bufs: per unit, its full flat buffer in the compute dtype (params are views of it).
        shard: this rank's partition in the compute dtype (every unit's shard, back to back).
        comm: data-parallel collectives with a byte ledger.
        chunk: elements per rank per all-gather (``allgather_bucket_size // dp``).
        in_backward: returns True while the engine runs a backward.
        secondary: hpZ's :class:`hybrid.zero.hpz.SecondaryPartition` (None: off).
        quantized: qwZ, primary-partition gathers in blockwise int8.
    """

    timer = NULL_TIMER
    """A :class:`hybrid.zero.profile.PhaseTimer` while profiling (param_gather)."""

    def __init__(self, model, layout: PartitionLayout, bufs, shard: torch.Tensor, comm: DPComm,
                 chunk: int, in_backward, secondary=None, quantized: bool = False):
        self.layout, self.bufs, self.shard, self.comm = layout, bufs, shard, comm
        self.chunk, self.in_backward = max(1, chunk), in_backward
        self.secondary, self.quantized = secondary, quantized
        self.managed = [not u.persistent for u in layout.units]
        self.from_primary = [False] * len(layout.units)
        self.state = [GATHERED] * len(layout.units)
        self.works: list[list] = [[] for _ in layout.units]
        self.live_bytes = self.peak_bytes = 0
        index = {u.name: u.index for u in layout.units}
        root = index.get(ROOT)
        self.root = root if root is not None and self.managed[root] else None
        self.blocks = []
        for i in range(len(getattr(model, "layers", []))):
            u = index.get(f"layers.{i}")
            self.blocks.append(u if u is not None and self.managed[u] else None)
        for u in range(len(layout.units)):
            if self.managed[u]:
                self._free(u)
        self.handles = [model.register_forward_pre_hook(self._model_pre),
                        model.register_forward_hook(self._model_post)]
        for i, block in enumerate(getattr(model, "layers", [])):
            self.handles.append(
                block.register_forward_pre_hook(functools.partial(self._block_pre, i)))
            self.handles.append(
                block.register_forward_hook(functools.partial(self._block_post, i)))

    # ---- gather / release ------------------------------------------------------------------
    def _nbytes(self, u: int) -> int:
        return self.bufs[u].numel() * self.bufs[u].element_size()

    def _free(self, u: int) -> None:
        self.bufs[u].untyped_storage().resize_(0)
        self.state[u] = RELEASED

    def gather(self, u: int | None, wait: bool = True) -> None:
        """Make unit ``u`` usable (``wait``) or start fetching it (prefetch)."""
        if u is None or not self.managed[u]:
            return
        with self.timer.phase("param_gather"):
            self._gather(u, wait)

    def _gather(self, u: int, wait: bool) -> None:
        if self.state[u] == RELEASED:
            unit, buf = self.layout.units[u], self.bufs[u]
            buf.untyped_storage().resize_(self._nbytes(u))
            self.live_bytes += self._nbytes(u)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            sec = self.secondary
            self.from_primary[u] = not (sec is not None and sec.current[u] and self.in_backward())
            if not self.from_primary[u]:
                self.works[u] = sec.gather(u, buf)
            else:
                self._gather_primary(unit, buf)
            self.state[u] = GATHERING
        if wait and self.state[u] == GATHERING:
            for w in self.works[u]:
                w.wait()
            self.works[u].clear()
            self.state[u] = GATHERED
            if self.secondary is not None and self.from_primary[u]:
                self.secondary.save(u, self.bufs[u])

    def _gather_primary(self, unit, buf: torch.Tensor) -> None:
        """Start unit ``unit``'s all-gathers from every data-parallel rank's shard."""
        s, dp = unit.shard, self.comm.size
        for lo, hi in self.layout.unit_chunks(unit.index, self.chunk):
            src = self.shard[unit.part_offset + lo:unit.part_offset + hi]
            if self.quantized:
                slots = [buf[r * s + lo:r * s + hi] for r in range(dp)]
                self.works[unit.index].append(quantized_all_gather(self.comm, slots, src))
                continue
            out = buf if (lo, hi) == (0, s) else [buf[r * s + lo:r * s + hi] for r in range(dp)]
            self.works[unit.index].append(self.comm.all_gather(out, src, async_op=True))

    def release(self, u: int) -> None:
        """Free unit ``u``'s gathered parameters (waits for an in-flight gather first)."""
        if not self.managed[u] or self.state[u] == RELEASED:
            return
        self.gather(u)
        self._free(u)
        self.live_bytes -= self._nbytes(u)

    def release_all(self) -> None:
        for u in range(len(self.layout.units)):
            self.release(u)

    # ---- hooks ------------------------------------------------------------------------------
    def _model_pre(self, module, args):
        if self.secondary is not None and not self.in_backward():
            self.secondary.invalidate()  # parameters may have changed since the last forward
        self.gather(self.root)
        if not self.in_backward() and self.blocks:
            self.gather(self.blocks[0], wait=False)

    def _model_post(self, module, args, out):
        if self.in_backward():
            return
        self.release(self.root) if self.root is not None else None
        t = _first_grad_tensor(out)
        if t is not None:
            last = self.blocks[-1] if self.blocks else None
            t.register_hook(functools.partial(self._pre_backward, self.root, last))

    def _block_pre(self, i, module, args):
        self.gather(self.blocks[i])
        if not self.in_backward() and i + 1 < len(self.blocks):
            self.gather(self.blocks[i + 1], wait=False)

    def _block_post(self, i, module, args, out):
        if self.in_backward():
            return
        if self.blocks[i] is not None:
            self.release(self.blocks[i])
        t = _first_grad_tensor(out)
        if t is not None:
            prev = self.blocks[i - 1] if i > 0 else None
            t.register_hook(functools.partial(self._pre_backward, self.blocks[i], prev))

    def _pre_backward(self, unit, prefetch, grad):
        self.gather(unit)
        self.gather(prefetch, wait=False)
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
