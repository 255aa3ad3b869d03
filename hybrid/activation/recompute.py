"""Full-recompute activation checkpointing of one transformer block, with ZeRO-R P_a and P_a+cpu.

Forward (grad enabled): the block runs under ``no_grad``, so none of its inner activations
are kept; only its input ``x [b, s, h]`` is saved (the *checkpoint*), together with every RNG
state the block may draw from. Backward: the input is brought back, the RNG states at the
block's forward are restored, the block is run again with grad (by *calling the module*, so
its forward hooks run again: a ZeRO-3 engine re-gathers its parameters there), its graph is
back-propagated, and the RNG states of the moment are put back.

- P_a (ZeRO paper, arXiv 1910.02054 §6.1): the block input is replicated on the ``t`` ranks of a
  tensor-parallel group, so each rank keeps only its ``1/t`` of the flattened input
  (``ceil(n / t)`` elements, zero-padded on the last rank) and one all-gather over the TP group
  rebuilds it just before recompute: exactly one extra all-gather per checkpointed block.
- P_a+cpu: the kept piece is copied to host memory and back to the device for recompute, by
  :class:`hybrid.activation.offload.HostOffload` (on CUDA: a side stream with events, the next
  checkpoint prefetched during a recompute, page-locked buffers reused from a pool).
- M_D: the kept pieces go into :class:`hybrid.activation.arena.CheckpointArena` slots.

Why our own autograd Function rather than ``torch.utils.checkpoint``: the TP dropout stream
lives in :class:`hybrid.parallel.rng.RNGTracker`, which ``preserve_rng_state`` does not know, and
P_a, the host copy and the arena need control over exactly which tensor is saved. It is re-entrant
(Megatron's ``CheckpointFunction`` design): backward runs a nested ``torch.autograd.backward``
on the recomputed block, so parameter gradients accumulate during the block's own backward, as
ZeRO's per-parameter gradient hooks expect. The Function never saves parameters, only the
module, so recompute uses whatever the parameters are at backward time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.activation.arena import CheckpointArena
from hybrid.activation.offload import HostOffload
from hybrid.parallel.ops import all_gather_flat
from hybrid.parallel.rng import RNGTracker, capture_torch_rng, restore_torch_rng

logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "_zeror_checkpoint"
"""Attribute set on every saved checkpoint tensor: ``"device"`` or ``"host"`` (where it lives);
:mod:`hybrid.activation.saved_bytes` uses it to tell checkpoints from other saved tensors."""


@dataclass
class CheckpointStats:
    """Counters of one :class:`ActivationStore`, cumulative since it was built."""

    checkpoints: int = 0
    """Checkpoints saved (one per checkpointed block per micro-batch)."""
    recomputes: int = 0
    """Blocks recomputed in backward."""
    allgathers: int = 0
    """All-gathers of partitioned checkpoints over the TP group (P_a), one per recompute."""
    standalone_allocations: int = 0
    """Checkpoint copies allocated on their own (without an arena, or when it overflowed)."""
    arena_overflows: int = 0
    """Checkpoints that did not find their arena slot free (two forwards before a backward)."""
    selective_recomputes: int = 0
    """Attention cores recomputed in backward (selective recompute)."""

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def partition_range(numel: int, parts: int, rank: int) -> tuple[int, int, int]:
    """``(chunk, start, real)``: each of ``parts`` ranks keeps ``chunk = ceil(numel / parts)``
    elements; rank ``rank``'s piece starts at ``start`` and its first ``real`` elements are real
    (the rest is padding, only on the last ranks)."""
    chunk = math.ceil(numel / parts)
    start = min(rank * chunk, numel)
    return chunk, start, min(chunk, numel - start)


@dataclass
class _Saved:
    """What backward needs besides the saved tensor itself (no parameters, no activations)."""

    shape: torch.Size
    numel: int
    device: torch.device
    partitioned: bool
    lease: object | None
    host: torch.Tensor | None = None
    """The host copy (``in_cpu``), for the prefetch of the next recompute."""
    pooled: bool = False
    """``host`` came from the offload pool (no arena) and goes back to it after backward."""
    copied: object = None
    """The device->host copy's CUDA event (None on CPU)."""
    prefetched: object = None
    """A started host->device copy (:meth:`HostOffload.start_to_device`), or None."""


class ActivationStore:
    """Decides how a checkpoint is kept (whole, 1/t piece, on host, in the arena) and brings it
    back; owns the counters. One per model, shared by its checkpointed blocks.

    Args:
        tp_group: tensor-parallel group (``grid.tp_group``); P_a gathers over it.
        partition: keep only this rank's ``1/t`` (ignored at ``t = 1``).
        in_cpu: keep the checkpoint in host memory.
        num_slots: arena slots (checkpointed blocks), or ``None`` for no arena.
        tracker: the TP dropout stream to save and restore with the default generators.
        sequence_parallel: the block inputs are already this rank's ``s/t`` slice (different on
            every TP rank), so P_a has nothing left to partition and is not applied.
    """

    def __init__(self, tp_group, partition: bool, in_cpu: bool, num_slots: int | None,
                 tracker: RNGTracker | None, sequence_parallel: bool = False):
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        self.partition = partition and self.tp_size > 1 and not sequence_parallel
        self.in_cpu = in_cpu
        self.tracker = tracker
        self.num_slots = num_slots
        self.arena: CheckpointArena | None = None
        self.stats = CheckpointStats()
        self.meter = None  # a hybrid.activation.saved_bytes meter while one is measuring
        self.offload: HostOffload | None = None
        self._offloaded: list[weakref.ref] = []  # host checkpoints in save order (LIFO)

    def _offload_for(self, device: torch.device) -> HostOffload:
        if self.offload is None or self.offload.device != device:
            self.offload = HostOffload(device)
        return self.offload

    def _arena_for(self, device: torch.device) -> CheckpointArena:
        host = self.in_cpu
        where = torch.device("cpu") if host else device
        if self.arena is None or self.arena.device != where:
            self.arena = CheckpointArena(self.num_slots, where,
                                         pin_memory=host and device.type == "cuda")
        return self.arena

    @torch.no_grad()
    def save(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, _Saved]:
        """The tensor to save for block ``index``'s input ``x``, and how to rebuild ``x``."""
        n = x.numel()
        self.stats.checkpoints += 1
        meta = _Saved(x.shape, n, x.device, self.partition, None)
        if not (self.partition or self.in_cpu or self.num_slots):
            stored = x.detach()  # an alias: the whole input is kept as it is
        else:
            chunk, start, real = (partition_range(n, self.tp_size, self.tp_rank) if self.partition
                                  else (n, 0, n))
            got = None
            if self.num_slots:
                got = self._arena_for(x.device).acquire(index, chunk, x.dtype)
                if got is None:
                    self.stats.arena_overflows += 1
                    if self.stats.arena_overflows == 1:
                        logger.warning("checkpoint arena slot %d still in use (a second forward "
                                       "before the backward?); allocating this checkpoint on its "
                                       "own", index)
            stored = self._destination(got, meta, chunk, x)
            flat = x.detach().reshape(-1)
            if self.in_cpu:
                meta.host = stored
                meta.copied = self._offload_for(x.device).to_host(stored[:real],
                                                                  flat[start:start + real])
                self._offloaded.append(weakref.ref(meta))
            else:
                stored[:real].copy_(flat[start:start + real], non_blocking=True)
            if real < chunk:
                stored[real:].zero_()
        setattr(stored, CHECKPOINT_TAG, "host" if self.in_cpu else "device")
        return stored, meta

    def _destination(self, got, meta: _Saved, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Where the checkpoint is copied: the arena slot ``got`` (lease into ``meta``), a
        pooled host buffer (``in_cpu``), or a new device tensor."""
        if got is not None:
            stored, meta.lease = got
            return stored
        if self.in_cpu:
            offload = self._offload_for(x.device)
            before = offload.allocations
            meta.pooled = True
            stored = offload.host_buffer(chunk, x.dtype)
            self.stats.standalone_allocations += offload.allocations - before
            return stored
        self.stats.standalone_allocations += 1
        return torch.empty(chunk, dtype=x.dtype, device=x.device)

    def _from_host(self, stored: torch.Tensor, meta: _Saved) -> torch.Tensor:
        """``meta``'s checkpoint on its device (prefetched or copied now), after starting the
        prefetch of the checkpoint saved before it (the next one recomputed)."""
        offload = self._offload_for(meta.device)
        handle = meta.prefetched or offload.start_to_device(stored, meta.copied)
        meta.prefetched = None
        live = [r for r in self._offloaded if r() is not None and r() is not meta]
        self._offloaded = live
        if live and live[-1]().prefetched is None and live[-1]().host is not None:
            nxt = live[-1]()
            nxt.prefetched = offload.start_to_device(nxt.host, nxt.copied)
            offload.prefetches += 1
        return offload.finish_to_device(handle)

    def load(self, stored: torch.Tensor, meta: _Saved) -> torch.Tensor:
        """Rebuild the block input ``[b, s, h]`` on its device (all-gather for P_a)."""
        if self.in_cpu:
            src = self._from_host(stored, meta)
        else:
            src = stored.to(meta.device, non_blocking=True)
        if meta.partitioned:
            full = torch.empty(src.numel() * self.tp_size, dtype=src.dtype, device=meta.device)
            all_gather_flat(full, src, self.tp_group)
            self.stats.allgathers += 1
            src = full
        return src[:meta.numel].view(meta.shape)

    def release(self, meta: _Saved) -> None:
        """Free the arena slot of a checkpoint whose backward is done."""
        if meta.lease is not None and self.arena is not None:
            self.arena.release(meta.lease)
            meta.lease = None
        if meta.pooled and meta.host is not None and self.offload is not None:
            self.offload.give_back(meta.host)
        meta.host = meta.prefetched = None


def autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    """``(device type, autocast enabled, autocast dtype)`` now, for a later recompute."""
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


@contextlib.contextmanager
def replaying_forward(store: ActivationStore, rng: dict, autocast: tuple, device: torch.device):
    """Run a recomputation as its forward ran: the RNG states captured then (CPU, CUDA, the TP
    tracker's stream, so dropout draws the same masks), the same autocast, grad enabled and the
    saved-bytes meter told it is a recompute; the current RNG states come back afterwards."""
    now = capture_torch_rng(store.tracker, device)
    restore_torch_rng(rng, store.tracker, device)
    kind, enabled, dtype = autocast
    meter = store.meter
    if meter is not None:
        meter.begin_recompute()
    try:
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            yield
    finally:
        restore_torch_rng(now, store.tracker, device)
        if meter is not None:
            meter.end_recompute()


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wrapper: CheckpointedForward, x: torch.Tensor) -> torch.Tensor:
        store = wrapper.store
        ctx.wrapper = wrapper
        ctx.rng, ctx.device = capture_torch_rng(store.tracker, x.device), x.device
        ctx.autocast = autocast_state(x.device)
        with torch.no_grad():
            out = wrapper.original(x)  # the module's hooks already ran around this call
        stored, ctx.meta = store.save(wrapper.index, x)
        ctx.save_for_backward(stored)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        wrapper: CheckpointedForward = ctx.wrapper
        store = wrapper.store
        (stored,) = ctx.saved_tensors
        x = store.load(stored, ctx.meta).detach().requires_grad_(True)
        with replaying_forward(store, ctx.rng, ctx.autocast, ctx.device):
            out = wrapper.recompute(x)
        store.stats.recomputes += 1
        torch.autograd.backward(out, grad_out)
        store.release(ctx.meta)
        return None, x.grad


class CheckpointedForward:
    """Replaces ``block.forward`` as an instance attribute, so the module tree and therefore
    parameter names (``layers.0.attn.qkv.weight``) do not change.

    ``block(x)`` runs the module's hooks, then this: with grad enabled it checkpoints, under
    ``no_grad`` (evaluation) it is the original forward. Recompute calls ``block(x)`` again
    with :attr:`recomputing` set, so the hooks run and the original forward is used.
    """

    def __init__(self, block: nn.Module, index: int, store: ActivationStore):
        self.block = block
        self.index = index
        self.store = store
        self.replaced = block.__dict__.get("forward")  # an instance-level forward we replace
        self.original = self.replaced or block.forward
        self.recomputing = False

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise TypeError("a checkpointed block takes exactly one tensor input [b, s, h]")
        if self.recomputing or not torch.is_grad_enabled():
            return self.original(x)
        if not x.requires_grad:
            # Without an input that requires grad the Function's output would not either, and
            # the block's parameter gradients would be lost silently.
            x = x.detach().requires_grad_(True)
        return _CheckpointFunction.apply(self, x)

    def recompute(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputing = True
        try:
            return self.block(x)
        finally:
            self.recomputing = False
