"""The contiguous activation-checkpoint arena (ZeRO-R M_D, arXiv 1910.02054 §6.3).

Checkpoints are long-lived (a block's forward to its backward) while the activations around
them are short-lived; allocating each checkpoint separately interleaves the two and fragments
the allocator. Instead one buffer with one slot per checkpointed block is allocated at the
first micro-batch and every checkpoint is *copied* into its slot (``slot[i]`` for block
``i``). The same buffer serves every later micro-batch: a slot is leased at the block's
forward and handed back after its backward, or when the autograd graph holding it is freed
(evaluation with gradients on but no backward), so nothing stays behind.

Slots are tensors built on the arena's storage with ``Tensor.set_`` rather than slicing views:
they alias the one buffer (``slot.untyped_storage()`` is the arena's) but each has its own
autograd version counter, so writing block ``j``'s checkpoint does not invalidate the saved
checkpoint of block ``i`` in autograd's in-place check, while rewriting a slot that a stale
graph still holds does raise.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

logger = logging.getLogger(__name__)


class _Lease:
    """Proof that a slot is in use; the slot is freed when this is released or collected."""

    __slots__ = ("index", "token", "__weakref__")

    def __init__(self, index: int, token: int):
        self.index = index
        self.token = token


class CheckpointArena:
    """One preallocated buffer of ``num_slots`` equal slots for the checkpoints of one micro-batch.

    Args:
        num_slots: number of checkpointed blocks.
        device: where the buffer lives (the activations' device, or CPU for ``checkpoint_in_cpu``).
        pin_memory: allocate page-locked host memory (CPU buffer on a CUDA machine), so
            device<->host copies can be asynchronous.

    Attributes:
        allocations: how many times the buffer was (re)allocated; stays 1 while the micro-batch
            shape does not grow.
    """

    def __init__(self, num_slots: int, device: torch.device | str, pin_memory: bool = False):
        if num_slots < 1:
            raise ValueError(f"a checkpoint arena needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.buffer: torch.Tensor | None = None
        self.slot_numel = 0
        self.allocations = 0
        self._slots: list[torch.Tensor] = []
        self._live: dict[int, int] = {}  # slot -> lease token
        self._tokens = itertools.count()

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (0 before the first micro-batch)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def live_slots(self) -> list[int]:
        """Slots holding a checkpoint whose backward has not run yet."""
        return sorted(self._live)

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` aliases this arena's buffer."""
        return (self.buffer is not None
                and tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr())

    def _allocate(self, slot_numel: int, dtype: torch.dtype) -> None:
        self.buffer = torch.empty(self.num_slots * slot_numel, dtype=dtype, device=self.device,
                                  pin_memory=self.pin_memory)
        self.slot_numel = slot_numel
        storage = self.buffer.untyped_storage()
        self._slots = [
            torch.empty(0, dtype=dtype, device=self.device).set_(storage, i * slot_numel,
                                                                 (slot_numel,))
            for i in range(self.num_slots)
        ]
        self.allocations += 1
        logger.info("checkpoint arena: %d slots x %d elements (%s, %d bytes) on %s",
                    self.num_slots, slot_numel, dtype, self.nbytes, self.device)

    def acquire(self, index: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                           _Lease] | None:
        """Lease slot ``index`` for a checkpoint of ``numel`` elements of ``dtype``.

        Grows (reallocates) the buffer when no slot is live and the request does not fit.

        Returns:
            ``(slot [numel], lease)``; or ``None`` when the slot is still live (two forwards
            before a backward) or the buffer is too small while other slots are live: the
            caller then allocates that checkpoint on its own.
        """
        if not 0 <= index < self.num_slots:
            raise IndexError(f"arena slot {index} out of range [0, {self.num_slots})")
        fits = (self.buffer is not None and numel <= self.slot_numel and self.buffer.dtype == dtype)
        if not fits:
            if self._live:
                return None
            self._allocate(numel, dtype)
        if index in self._live:
            return None
        lease = _Lease(index, next(self._tokens))
        self._live[index] = lease.token
        weakref.finalize(lease, self._free, index, lease.token)
        slot = self._slots[index]
        return (slot if numel == self.slot_numel else slot[:numel]), lease

    def release(self, lease: _Lease) -> None:
        """Hand a slot back (after the backward that read it)."""
        self._free(lease.index, lease.token)

    def _free(self, index: int, token: int) -> None:
        # Also called when the lease dies with its autograd graph: free the slot unless it was
        # released and leased again since.
        if self._live.get(index) == token:
            del self._live[index]
