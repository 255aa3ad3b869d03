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
Reductions run in the gradient dtype (fp32, or bf16 with ``grad_reduce_in_bf16``) and average
over ranks: pre-divided by the data-parallel size, or with fusion divided after the sum (exact
for a power-of-two dp).

Gradient-accumulation fusion (``fusion``, Megatron-LM's ``--gradient-accumulation-fusion``):
stage 0/1 parameters whose dtype is the gradient's get ``p.grad`` = their view of the full flat
buffer (Megatron's ``main_grad``), so autograd accumulates in place and the hook adds nothing;
16-bit parameters with fp32 gradients get ``p.main_grad`` = that view instead
(:func:`hybrid.parallel.linear.main_grad.attach_main_grad`), and the weight-gradient GEMMs of the
tensor-parallel linears accumulate into it in fp32 (the hook drops their placeholder ``p.grad``;
embeddings, norms and biases are still added by the hook) where the device has such a GEMM
(:func:`wgrad_fusion`); stage 1 reduce-scatters each unit in place in that buffer
(:func:`unit_reduce_plan`), with no staging; stage 2/3 write each bucket's staging input once
(copies, plus zeroes only where no gradient lands) and average the reduced chunk as they add it
into the partition.
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

import torch

from hybrid.parallel.linear.gemm import wgrad_kernel
from hybrid.parallel.linear.main_grad import (
    attach_main_grad,
    detach_main_grad,
    gradient_in_main_grad,
)
from hybrid.zero.comm import DPComm
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.profile import NULL_TIMER
from hybrid.zero.reduce_plan import (  # noqa: F401 (re-exported: the plan's values)
    FlatCopy,
    GradCopy,
    ReduceBucket,
    ReducePlan,
    reduce_plan,
    unit_reduce_plan,
)
from hybrid.zero.stage import StagePlan


def wgrad_fusion(plan: StagePlan, fusion: bool, param_dtype: torch.dtype,
                 grad_dtype: torch.dtype, device) -> str | None:
    """Why the weight-gradient GEMMs of ``param_dtype`` weights do not accumulate straight into
    the ``grad_dtype`` buffer on ``device``; None when they do (16-bit weights, fp32 gradients,
    stage 0/1, fusion on, a GEMM that writes fp32 from 16-bit operands:
    :func:`hybrid.parallel.linear.gemm.wgrad_kernel`). Raises nothing."""
    if not fusion:
        return "--no-gradient-accumulation-fusion"
    if param_dtype == grad_dtype:
        return "the parameters are in the gradient's dtype (p.grad is the buffer's view)"
    if plan.shards_gradients:
        return ("stages 2/3 hold no full fp32 gradient to accumulate into: each micro-batch's "
                "16-bit gradient is reduce-scattered from p.grad")
    kernel, why = wgrad_kernel(device)
    return None if kernel is not None else why


def fusion_words(config, device="cpu") -> str:
    """What ``--gradient-accumulation-fusion`` does for ``config`` (a ``ZeroConfig``) on
    ``device``, and where it is inactive for 16-bit weights with fp32 gradients, why
    (:func:`wgrad_fusion`)."""
    if not config.gradient_accumulation_fusion:
        return "added per parameter and staged (--no-gradient-accumulation-fusion)"
    words = "accumulated straight into the main-grad buffer (--gradient-accumulation-fusion)"
    if config.dtype == config.grad_dtype:
        return words
    why = wgrad_fusion(config.plan, True, config.dtype, config.grad_dtype, device)
    if why is None:
        return (f"{config.precision} weight gradients {words} by fp32-writing weight-gradient "
                f"GEMMs ({wgrad_kernel(device)[0]}), the other gradients added per parameter")
    return f"{words} except the {config.precision} weight gradients: fusion inactive, {why}"


class _MainGrads:
    """The parameters given a ``main_grad``; ``remove()`` takes it away (``close``)."""

    def __init__(self, params):
        self.params = params

    def remove(self) -> None:
        for p in self.params:
            detach_main_grad(p)


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
        grad_dtype: the dtype gradients accumulate and travel in (fp32, or bf16).
        fusion: gradient-accumulation fusion (see the module docstring).
    """

    timer = NULL_TIMER
    """A :class:`hybrid.zero.profile.PhaseTimer` while profiling (hooks, copies, grad_comm)."""

    def __init__(self, params, layout: PartitionLayout, plan: StagePlan, comm: DPComm,
                 bucket_size: int, overlap: bool, on_unit_ready=None,
                 grad_dtype: torch.dtype = torch.float32, fusion: bool = False):
        self.params, self.layout, self.plan, self.comm = params, layout, plan, comm
        self.overlap, self.on_unit_ready = overlap, on_unit_ready
        self.grad_dtype = grad_dtype
        dp, dev = comm.size, params[0].device
        self.main_grad: list[torch.Tensor | None] = [None] * len(params)
        """Stage 0/1 with ``fusion``: per parameter, its view of the full flat gradient that
        autograd accumulates into (``p.grad`` is that view; None: the hook adds it)."""
        if not plan.shards_gradients:
            self.grad_flat = torch.zeros(layout.total_numel, dtype=grad_dtype, device=dev)
            if fusion:
                self.main_grad = [self._flat_view(s) if p.dtype == grad_dtype else None
                                  for s, p in zip(layout.slots, params, strict=True)]
        else:
            self.grad_part = torch.zeros(layout.partition_numel, dtype=grad_dtype, device=dev)
        self.one_pass = fusion and plan.shards_gradients
        """Stage 2/3 with ``fusion``: the staging input is written once (gradient copies, zeroes
        only where no gradient lands) and the 1/dp mean is applied to the reduced chunk."""
        self.unit_in_place = fusion and plan.shards_optimizer_states and not (
            plan.shards_gradients or plan.grad_all_reduce)
        """Stage 1 with ``fusion``: each unit is reduce-scattered in place in the full flat
        gradient (its shards are rank-major there), no staging copy."""
        rp = (unit_reduce_plan(layout) if self.unit_in_place
              else reduce_plan(layout, plan, dp, comm.rank, bucket_size))
        self.buckets, self.unit_buckets = rp.buckets, rp.unit_buckets
        self.staging = self._staging(rp.chunk, 2 if overlap else 1, dev)
        self.inflight: deque = deque()
        self.reduce_now = self.last = False
        self.on_unit_reduced = None
        """Called with a unit index when, in the last micro-batch's backward, the reduction of
        the unit's last bucket has finished (``--optimizer-cpu-offload`` copies it to the host)."""
        self._reset()
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                      for i, p in enumerate(params)]
        fused = [i for i, p in enumerate(params)
                 if wgrad_fusion(plan, fusion, p.dtype, grad_dtype, dev) is None]
        for i in fused:
            attach_main_grad(params[i], self._flat_view(layout.slots[i]))
        self.wgrad_fused = [params[i] for i in fused]
        """Stage 0/1, 16-bit parameters with fp32 gradients and fusion: those whose weight-
        gradient GEMMs accumulate into their ``p.main_grad`` view of the full flat buffer."""
        self.hooks.append(_MainGrads(self.wgrad_fused))

    def _flat_view(self, slot) -> torch.Tensor:
        return self.grad_flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _staging(self, chunk: int, nstage: int, dev) -> list[tuple[torch.Tensor, ...]]:
        """Per in-flight collective: (reduce-scatter input, output, gloo scratch) buffers.
        Stage 1 reduced unit by unit in place needs only the gloo scratch (a unit's size)."""
        dp, plan = self.comm.size, self.plan
        if self.unit_in_place:
            n = max(u.padded for u in self.layout.units) if self.comm.needs_scratch else 0
            return [tuple(torch.zeros(k, dtype=self.grad_dtype, device=dev) for k in (0, 0, n))
                    for _ in range(nstage)] if n else []
        if plan.grad_in_place:
            return []
        scratch = dp * chunk if self.comm.needs_scratch and not plan.grad_all_reduce else 0
        return [tuple(torch.zeros(k, dtype=self.grad_dtype, device=dev)
                      for k in (dp * chunk, chunk, scratch)) for _ in range(nstage)]

    # ---- state of one backward ---------------------------------------------------------------
    def _reset(self) -> None:
        self.pending = [len(u.slots) for u in self.layout.units]
        self.ready = [False] * len(self.layout.units)
        self.left = list(self.unit_buckets)
        self.next_bucket = 0
        self.launched = 0

    def begin_backward(self, reduce_now: bool, last: bool = False) -> None:
        """Call before each micro-batch's backward; ``reduce_now`` reduces in this one, ``last``:
        it is the optimizer step's last (its reduced gradients are final).
        With fusion, every parameter whose dtype is the gradient's gets ``p.grad`` = its view of
        the full flat gradient, so autograd accumulates into it in place."""
        if self.inflight:
            raise RuntimeError("a gradient reduction is still in flight from the last backward")
        self.reduce_now, self.last = reduce_now, last
        self._reset()
        for p, view in zip(self.params, self.main_grad, strict=True):
            if view is not None and p.grad is not view:
                p.grad = view

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
                if self.main_grad[i] is not None:
                    if p.grad is not self.main_grad[i]:  # someone replaced it: add and restore
                        with self.timer.phase("copies"):
                            self.main_grad[i].add_(p.grad)
                        p.grad = self.main_grad[i]
                elif not self.plan.shards_gradients:
                    if not gradient_in_main_grad(p):  # else a GEMM put it there already
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
        inv = 1.0 / self.comm.size
        if self.plan.grad_in_place:
            view = self.grad_flat[bucket.start:bucket.end]
            if inv != 1.0:
                with self.timer.phase("copies"):
                    view.mul_(inv)
            with self.timer.phase("grad_comm"):
                work = self.comm.all_reduce(view, async_op=self.overlap)
            self.inflight.append((work, bucket, None))
        elif self.unit_in_place:
            self._launch_unit(bucket)
        else:
            self._launch_staged(bucket, inv)
        self.launched += 1
        if not self.overlap:
            self._finish()

    def _launch_unit(self, bucket: ReduceBucket) -> None:
        """Stage 1 with fusion: reduce-scatter the unit's full flat gradient in place into this
        rank's own shard of it (NCCL's in-place form; gloo's composition sums into it)."""
        if self.staging and len(self.inflight) >= len(self.staging):
            self._finish()
        u, rank = self.layout.units[bucket.units[0]], self.comm.rank
        inp = self.grad_flat[u.offset:u.offset + u.padded]
        out = inp[rank * u.shard:(rank + 1) * u.shard]
        scratch = self.staging[self.launched % len(self.staging)][2] if self.staging else None
        with self.timer.phase("grad_comm"):
            work = self.comm.reduce_scatter(out, inp, async_op=self.overlap, scratch=scratch)
        self.inflight.append((work, bucket, out))

    def _launch_staged(self, bucket: ReduceBucket, inv: float) -> None:
        if len(self.inflight) >= len(self.staging):
            self._finish()
        k = self.launched % len(self.staging)
        n = bucket.end - bucket.start
        inp, out = self.staging[k][0][:self.comm.size * n], self.staging[k][1][:n]
        scratch = self.staging[k][2] if self.staging[k][2].numel() else None
        with self.timer.phase("copies"):
            self._stage_in(bucket, inp)
            if inv != 1.0 and not self.one_pass:
                inp.mul_(inv)
        with self.timer.phase("grad_comm"):
            if self.plan.grad_all_reduce:
                work = self.comm.all_reduce(inp, async_op=self.overlap)
                out = inp[self.comm.rank * n:(self.comm.rank + 1) * n]
            else:
                work = self.comm.reduce_scatter(out, inp, async_op=self.overlap,
                                                scratch=scratch)
        self.inflight.append((work, bucket, out))

    def _stage_in(self, bucket: ReduceBucket, inp: torch.Tensor) -> None:
        """Copy the bucket's gradients into its staging input ``inp``: one multi-tensor
        ``_foreach_copy_`` (a 1.5B model at dp 8 has ~1,200 pieces per backward; a ``copy_``
        each was a kernel launch each on CUDA). Values are those of the per-piece copies.
        Stage 2/3 zeroes what no gradient covers: the whole input, or with ``one_pass`` only
        the padding and the pieces of parameters without a gradient."""
        if not self.plan.shards_gradients:
            dst = [inp[c.dst:c.dst + c.length] for c in bucket.copy_in]
            src = [self.grad_flat[c.src:c.src + c.length] for c in bucket.copy_in]
        else:
            if not self.one_pass:
                inp.zero_()
            else:
                for a, b in bucket.gaps:
                    inp[a:b].zero_()
            dst, src = [], []
            for c in bucket.copy_in:
                g = self.params[c.param].grad
                if g is not None:
                    dst.append(inp[c.dst:c.dst + c.length])
                    src.append(g.reshape(-1)[c.param_start:c.param_start + c.length])
                elif self.one_pass:
                    inp[c.dst:c.dst + c.length].zero_()
        if dst:
            torch._foreach_copy_(dst, src)

    def _finish(self) -> None:
        work, bucket, out = self.inflight.popleft()
        with self.timer.phase("grad_comm"):
            work.wait()
        inv = 1.0 / self.comm.size
        with self.timer.phase("copies"):
            if self.plan.shards_gradients:
                self.grad_part[bucket.start:bucket.end].add_(
                    out, alpha=inv if self.one_pass else 1.0)
            elif self.unit_in_place:
                if inv != 1.0:
                    out.mul_(inv)
            elif not self.plan.grad_in_place and bucket.copy_out:
                torch._foreach_copy_(
                    [self.grad_flat[c.dst:c.dst + c.length] for c in bucket.copy_out],
                    [out[c.src:c.src + c.length] for c in bucket.copy_out])
        for u in bucket.units:
            self.left[u] -= 1
            if self.left[u] == 0 and self.last and self.on_unit_reduced is not None:
                self.on_unit_reduced(u)
            if self.left[u] == 0 and self.plan.shards_gradients:
                for s in self.layout.units[u].slots:
                    self.params[s].grad = None

    # ---- views for the optimizer and the norm ---------------------------------------------
    def grad_view(self, frag) -> torch.Tensor:
        """fp32 gradient of a fragment (stage 0/1: in the full flat; 2/3: in the partition)."""
        if not self.plan.shards_gradients:
            return self.grad_flat[frag.flat_offset:frag.flat_offset + frag.length]
        return self.grad_part[frag.part_offset:frag.part_offset + frag.length]

    def owned_grad(self, u: int) -> torch.Tensor:
        """``[shard]`` view of this rank's reduced gradient of unit ``u`` (its partition slice at
        stages 2/3; its own shard of the full flat buffer at stages 0/1), stages 1-3."""
        unit = self.layout.units[u]
        if self.plan.shards_gradients:
            return self.grad_part[unit.part_offset:unit.part_offset + unit.shard]
        a = unit.offset + self.comm.rank * unit.shard
        return self.grad_flat[a:a + unit.shard]

    @property
    def buffer(self) -> torch.Tensor:
        """The whole fp32 gradient buffer this rank holds."""
        return self.grad_part if self.plan.shards_gradients else self.grad_flat

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.staging for t in pair)

    def zero(self) -> None:
        self.buffer.zero_()
