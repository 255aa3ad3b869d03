"""Gradient accumulation (fp32) and bucketed data-parallel reduction of the ZeRO engine.

Every parameter has a post-accumulate-grad hook. What it does depends on the stage:

- stage 0/1: the 16/32-bit ``p.grad`` is added into one fp32 *full flat* gradient buffer
  (Megatron's ``main_grad``) and dropped; micro-batches accumulate there, and only the last
  micro-batch's backward reduces (stage 0: all-reduce of flat ranges in place; stage 1:
  reduce-scatter, each rank keeping the sum of the slices it owns in the same buffer);
- stage 2/3: ``p.grad`` stays until every bucket covering its unit has been reduce-scattered,
  then it is freed; each rank adds the reduced sum of its shard into an fp32 *partition*
  buffer, so gradients of every micro-batch are reduced in their own backward and non-owned
  gradient memory is not kept.

Buckets are fixed ranges of the layout (``PartitionLayout.reduce_buckets``), launched strictly
in plan order (last block first) as soon as every unit they touch has all its gradients, so
every rank issues the same collectives in the same order whatever order hooks fire in. With
``overlap`` the reductions are asynchronous and two staging buffers alternate (the older one is
waited for before reuse); without it everything is reduced synchronously after backward.
Reductions run in fp32 and are pre-divided by the data-parallel size (a mean over ranks).
On NCCL an asynchronous collective runs on the process group's own stream, ordered after the
staging copies on the compute stream; ``wait()`` only makes the compute stream wait for it, so
overlapped reductions never block the host.
On gloo each staging buffer has a scratch twin that receives the composed reduce-scatter's
all-to-all (``hybrid.zero.comm``).
With ``grad_reduce="all_reduce"`` stage 1 all-reduces its full flat buffer in place (the stage-0
plan: no staging) and stages 2/3 all-reduce the staged bucket and keep their own chunk of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from hybrid.zero.comm import DPComm
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.profile import NULL_TIMER
from hybrid.zero.stage import StagePlan


@dataclass(frozen=True)
class FlatCopy:
    """Copy ``length`` elements from offset ``src`` of one flat buffer to offset ``dst`` of another
    (stage 1: full-flat gradient <-> reduce-scatter staging)."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class GradCopy:
    """Copy ``length`` elements of ``params[param].grad`` (flattened, from ``param_start``) to
    offset ``dst`` of the reduce-scatter input (stage 2/3)."""

    param: int
    param_start: int
    dst: int
    length: int


@dataclass(frozen=True)
class ReduceBucket:
    """One collective of the static reduction plan.

    Attributes:
        start, end: the bucket's range, in the full flat buffer (stage 0) or in the partition
            (stages 1-3: every rank's chunk is ``end - start`` elements).
        units: layout units the bucket touches (it launches once they are all ready).
        copy_in: what fills the reduce-scatter input (``FlatCopy`` at stage 1, ``GradCopy`` at 2/3).
        copy_out: stage 1: where the reduced chunk goes back in the full flat gradient.
    """

    start: int
    end: int
    units: tuple[int, ...]
    copy_in: tuple[FlatCopy | GradCopy, ...] = ()
    copy_out: tuple[FlatCopy, ...] = ()


@dataclass(frozen=True)
class ReducePlan:
    """The static reduction plan of one rank: the same collectives in the same order on every
    rank (only ``copy_out`` differs, by the rank's own shard)."""

    buckets: tuple[ReduceBucket, ...]
    """In launch order (last block first)."""
    chunk: int
    """Elements of every rank's chunk of a staged bucket (0: reduced in place, no staging)."""
    unit_buckets: tuple[int, ...]
    """Per layout unit, how many buckets touch it (its gradients are freed after the last)."""


def reduce_plan(layout: PartitionLayout, plan: StagePlan, dp: int, rank: int,
                bucket_size: int) -> ReducePlan:
    """The buckets data-parallel rank ``rank`` of ``dp`` reduces, for the stage's ``plan``.

    In place (stage 0; stage 1 by all-reduce): ranges of the full flat buffer of about
    ``bucket_size`` elements. Otherwise every bucket is a range of the partition of ``chunk =
    min(bucket_size // dp, partition_numel)`` elements whose reduce-scatter input gathers, for
    each rank ``r``, rank ``r``'s shard of the same range (from the full flat gradient at stage
    1, from the parameters' ``.grad`` at stages 2/3). No collective, no tensor.
    """
    L = layout
    if plan.grad_in_place:
        buckets = tuple(ReduceBucket(a, b, tuple(L.units_of_flat(a, b)))
                        for a, b in L.flat_buckets(bucket_size))
        chunk = 0
    else:
        chunk = min(max(1, bucket_size // dp), L.partition_numel)
        buckets = tuple(_staged_bucket(L, a, b, dp, rank, plan.shards_gradients)
                        for a, b in L.reduce_buckets(chunk))
    unit_buckets = [0] * len(L.units)
    for bucket in buckets:
        for u in bucket.units:
            unit_buckets[u] += 1
    return ReducePlan(buckets, chunk, tuple(unit_buckets))


def _staged_bucket(L: PartitionLayout, a: int, b: int, dp: int, rank: int,
                   from_params: bool) -> ReduceBucket:
    """Partition range ``[a, b)`` as one staged bucket: rank ``r``'s shard of it lands at
    ``[r * (b - a), (r + 1) * (b - a))`` of the reduce-scatter input."""
    n, ins, outs, units = b - a, [], [], []
    q = 0
    for pc in L.pieces(a, b):
        u = L.units[pc.unit]
        units.append(pc.unit)
        length = pc.hi - pc.lo
        for r in range(dp):
            src = u.offset + r * u.shard + pc.lo
            if not from_params:
                ins.append(FlatCopy(src, r * n + q, length))
            else:
                ins.extend(GradCopy(s, ps, r * n + q + rel, ln)
                           for s, ps, ln, rel in L.segments(src, length))
        outs.append(FlatCopy(q, u.offset + rank * u.shard + pc.lo, length))
        q += length
    return ReduceBucket(a, b, tuple(units), tuple(ins), tuple(outs))


class GradReducer:
    """Args:
        params: the model's parameters in layout order (``layout.slots[i]`` is ``params[i]``).
        layout: the partition layout.
        plan: the engine's stage plan (what is partitioned, which collective, in place or not).
        comm: data-parallel collectives with a byte ledger.
        bucket_size: elements per reduction bucket, all ranks' chunks together.
        overlap: reduce during backward (True) or after it.
        on_unit_ready: called with a unit index once all its gradients have accumulated in
            this backward (stage 3 releases the unit's gathered parameters there).
    """

    timer = NULL_TIMER
    """A :class:`hybrid.zero.profile.PhaseTimer` while profiling (hooks, copies, grad_comm)."""

    def __init__(self, params, layout: PartitionLayout, plan: StagePlan, comm: DPComm,
                 bucket_size: int, overlap: bool, on_unit_ready=None):
        self.params, self.layout, self.plan, self.comm = params, layout, plan, comm
        self.overlap, self.on_unit_ready = overlap, on_unit_ready
        dp, dev = comm.size, params[0].device
        if not plan.shards_gradients:
            self.grad_flat = torch.zeros(layout.total_numel, dtype=torch.float32, device=dev)
        else:
            self.grad_part = torch.zeros(layout.partition_numel, dtype=torch.float32, device=dev)
        rp = reduce_plan(layout, plan, dp, comm.rank, bucket_size)
        self.buckets, self.unit_buckets, chunk = rp.buckets, rp.unit_buckets, rp.chunk
        nstage = 2 if overlap else 1
        scratch = dp * chunk if comm.needs_scratch and not plan.grad_all_reduce else 0
        self.staging = [] if plan.grad_in_place else [
            tuple(torch.zeros(k, dtype=torch.float32, device=dev)
                  for k in (dp * chunk, chunk, scratch))
            for _ in range(nstage)]
        self.inflight: deque = deque()
        self.reduce_now = False
        self._reset()
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                      for i, p in enumerate(params)]

    # ---- state of one backward ---------------------------------------------------------------
    def _reset(self) -> None:
        self.pending = [len(u.slots) for u in self.layout.units]
        self.ready = [False] * len(self.layout.units)
        self.left = list(self.unit_buckets)
        self.next_bucket = 0
        self.launched = 0

    def begin_backward(self, reduce_now: bool) -> None:
        """Call before each micro-batch's backward; ``reduce_now`` reduces in this one."""
        if self.inflight:
            raise RuntimeError("a gradient reduction is still in flight from the last backward")
        self.reduce_now = reduce_now
        self._reset()

    def end_backward(self) -> None:
        """After backward: treat units without gradients as ready, reduce what is left, wait."""
        for u in range(len(self.layout.units)):
            if not self.ready[u]:
                self._unit_ready(u, launch=False)
        if self.reduce_now:
            self._launch_ready()
            while self.inflight:
                self._finish()
        self._reset()

    # ---- hooks -------------------------------------------------------------------------------
    def _hook(self, i: int):
        slot = self.layout.slots[i]

        def hook(p: torch.Tensor) -> None:
            with self.timer.phase("hooks"):
                if not self.plan.shards_gradients:
                    with self.timer.phase("copies"):
                        flat = self.grad_flat[slot.offset:slot.offset + slot.numel]
                        flat.add_(p.grad.reshape(-1))
                    p.grad = None
                elif self.ready[slot.unit]:
                    raise RuntimeError(f"gradient of {slot.name} arrived twice in one backward; "
                                       "ZeRO stage 2/3 reduces a unit once its gradients are "
                                       "complete")
                self.pending[slot.unit] -= 1
                if self.pending[slot.unit] == 0:
                    self._unit_ready(slot.unit, launch=self.overlap)

        return hook

    def _unit_ready(self, u: int, launch: bool) -> None:
        self.ready[u] = True
        if self.on_unit_ready is not None:
            self.on_unit_ready(u)
        if launch and self.reduce_now:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_bucket < len(self.buckets) and all(
                self.ready[u] for u in self.buckets[self.next_bucket].units):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    # ---- one bucket --------------------------------------------------------------------------
    def _launch(self, bucket: ReduceBucket) -> None:
        a, b = bucket.start, bucket.end
        inv = 1.0 / self.comm.size
        if self.plan.grad_in_place:
            view = self.grad_flat[a:b]
            if inv != 1.0:
                with self.timer.phase("copies"):
                    view.mul_(inv)
            with self.timer.phase("grad_comm"):
                work = self.comm.all_reduce(view, async_op=self.overlap)
            self.inflight.append((work, bucket, None))
        else:
            if len(self.inflight) >= len(self.staging):
                self._finish()
            k = self.launched % len(self.staging)
            n = b - a
            inp, out = self.staging[k][0][:self.comm.size * n], self.staging[k][1][:n]
            scratch = self.staging[k][2] if self.staging[k][2].numel() else None
            with self.timer.phase("copies"):
                self._stage_in(bucket, inp)
                if inv != 1.0:
                    inp.mul_(inv)
            with self.timer.phase("grad_comm"):
                if self.plan.grad_all_reduce:
                    work = self.comm.all_reduce(inp, async_op=self.overlap)
                    out = inp[self.comm.rank * n:(self.comm.rank + 1) * n]
                else:
                    work = self.comm.reduce_scatter(out, inp, async_op=self.overlap,
                                                    scratch=scratch)
            self.inflight.append((work, bucket, out))
        self.launched += 1
        if not self.overlap:
            self._finish()

    def _stage_in(self, bucket: ReduceBucket, inp: torch.Tensor) -> None:
        """Copy the bucket's gradients into its staging input ``inp``: one multi-tensor
        ``_foreach_copy_`` (a 1.5B model at dp 8 has ~1,200 pieces per backward; a ``copy_``
        each was a kernel launch each on CUDA). Values are those of the per-piece copies."""
        if not self.plan.shards_gradients:
            dst = [inp[c.dst:c.dst + c.length] for c in bucket.copy_in]
            src = [self.grad_flat[c.src:c.src + c.length] for c in bucket.copy_in]
        else:
            inp.zero_()
            dst, src = [], []
            for c in bucket.copy_in:
                g = self.params[c.param].grad
                if g is not None:
                    dst.append(inp[c.dst:c.dst + c.length])
                    src.append(g.reshape(-1)[c.param_start:c.param_start + c.length])
        if dst:
            torch._foreach_copy_(dst, src)

    def _finish(self) -> None:
        work, bucket, out = self.inflight.popleft()
        with self.timer.phase("grad_comm"):
            work.wait()
        with self.timer.phase("copies"):
            if self.plan.shards_gradients:
                self.grad_part[bucket.start:bucket.end].add_(out)
            elif not self.plan.grad_in_place and bucket.copy_out:
                torch._foreach_copy_(
                    [self.grad_flat[c.dst:c.dst + c.length] for c in bucket.copy_out],
                    [out[c.src:c.src + c.length] for c in bucket.copy_out])
        for u in bucket.units:
            self.left[u] -= 1
            if self.left[u] == 0 and self.plan.shards_gradients:
                for s in self.layout.units[u].slots:
                    self.params[s].grad = None

    # ---- views for the optimizer and the norm ---------------------------------------------
    def grad_view(self, frag) -> torch.Tensor:
        """fp32 gradient of a fragment (stage 0/1: in the full flat; 2/3: in the partition)."""
        if not self.plan.shards_gradients:
            return self.grad_flat[frag.flat_offset:frag.flat_offset + frag.length]
        return self.grad_part[frag.part_offset:frag.part_offset + frag.length]

    @property
    def buffer(self) -> torch.Tensor:
        """The whole fp32 gradient buffer this rank holds."""
        return self.grad_part if self.plan.shards_gradients else self.grad_flat

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.staging for t in pair)

    def zero(self) -> None:
        self.buffer.zero_()
