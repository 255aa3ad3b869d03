"""Host copies of CPU-offloaded activation checkpoints (ZeRO-R P_a+cpu, arXiv 1910.02054 §6.1).

On CUDA the copies run on a side stream so that they overlap the compute stream:

- forward: the device->host copy of a checkpoint waits (an event) for the compute stream to have
  produced the block input, then runs on the side stream; the source is marked as used there
  (``record_stream``), so the allocator does not hand its memory out before the copy is done;
- backward: loading block ``i``'s checkpoint starts the host->device copy of the checkpoint
  recomputed next (block ``i - 1``'s, the previous one saved) on the side stream, so it arrives
  while block ``i`` recomputes; the compute stream waits for a copy's event only when it needs it;
- host buffers are page-locked and reused: a checkpoint's buffer goes back to a pool after its
  backward, so without the arena a pinned buffer is allocated only while the pool has none of
  that size (page-locking is slow, and fresh pinned memory per checkpoint per micro-batch
  would grow the process).

On CPU there is no stream: every copy is a plain synchronous ``copy_`` and prefetching is a
no-op, so the CPU numerics are those of the copies themselves. The pool works on both.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class HostOffload:
    """Moves checkpoints between ``device`` and (pinned, pooled) host memory.

    Args:
        device: the activations' device. CUDA: copies on a side stream (see the module
            docstring); anything else: synchronous copies.

    Attributes:
        allocations: host buffers allocated (the pool had none of the size and dtype).
        prefetches: host->device copies started ahead of their load.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.allocations = 0
        self.prefetches = 0

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``[numel]`` host buffer of ``dtype`` from the pool, or a new one (pinned on CUDA)."""
        free = self.pool[numel, dtype]
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a host buffer whose checkpoint's backward is done (reused by the next save).
        On CUDA its last read, the host->device copy, is ordered before any later write: both
        run on the side stream."""
        self.pool[buf.numel(), buf.dtype].append(buf)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy device ``src`` into host ``dst``; returns the copy's CUDA event (None on CPU)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            return self.stream.record_event()

    def start_to_device(self, host: torch.Tensor, after=None):
        """Begin the host->device copy of ``host`` (after event ``after``, the device->host copy
        that filled it); returns a handle for :meth:`finish_to_device`."""
        if not self.cuda:
            return host, None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            out = host.to(self.device, non_blocking=True)
            return out, self.stream.record_event()

    def finish_to_device(self, handle) -> torch.Tensor:
        """The device tensor of :meth:`start_to_device`, usable on the current stream."""
        out, done = handle
        if done is None:
            return out.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        out.record_stream(compute)  # allocated on the side stream, used and freed on this one
        return out
