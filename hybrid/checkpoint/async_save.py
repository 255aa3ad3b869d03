"""``--async-save``: write checkpoints in the background while training goes on.

As Megatron-LM's ``--async-save``: the save call only copies each rank's state to host memory;
a background thread streams it to the shard file; the checkpoint is finalised (published)
later, when every rank's write has finished. Here:

1. **Snapshot** (:func:`snapshot`, the only part training waits for): each rank copies the
   tensors of its part in the job's ``--ckpt-format`` (its ZeRO partition's fp32 master and
   Adam moments, and its RNG states: :meth:`hybrid.checkpoint.format.CheckpointFormat.part`)
   into one host buffer, pinned when the states are on a GPU (the copies are then
   asynchronous, and synchronised once). The buffer is kept for the next save. Its size is
   :func:`snapshot_bytes`, which the dry run reports.
2. **Write**: a daemon thread writes the snapshot into ``iter_N.tmp/`` in the format
   (:func:`hybrid.checkpoint.shards.write_shard`; file writes release the GIL). It keeps the
   default CPU priority: a niced thread that holds the GIL while the OS runs others stalls the
   training thread, which must hand the GIL over to it (priority inversion).
3. **Publish**: after each iteration every rank calls :meth:`AsyncSaver.poll`; while a save is
   pending it all-reduces "my write has finished" (MIN: one integer per iteration) on the host,
   over a gloo group when the job's tensors live on a GPU, so the poll never waits for the
   device (an all-reduce there and reading its result would sync the host with the GPU every
   iteration). Only when every rank has finished do they agree on the outcome and rank 0
   publishes (metadata, rename, pointer, retention), exactly as a synchronous save does.

The next save, the end of training and a stop wait for the pending save (:meth:`wait`) before
going on. A process killed at any point of the background write leaves the previous checkpoint
published and pointed to (only the unpublished ``iter_N.tmp`` stays behind), so a resume is
exact from it. A failed write (full disk) is reported at publication like a synchronous one.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybrid.checkpoint.agree import all_succeed
from hybrid.checkpoint.registry import DEFAULT_FORMAT, format_named
from hybrid.checkpoint.stream import Entry

if TYPE_CHECKING:
    from hybrid.checkpoint.format import CheckpointFormat, RankPart
    from hybrid.checkpoint.retention import Retention
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.zero.engine import ZeroEngine

ALIGN = 64
"""Bytes each tensor's place in the snapshot buffer is aligned to."""
def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def snapshot_bytes(entries: list[Entry]) -> int:
    """Bytes of the host buffer :func:`snapshot` fills for ``entries`` (each tensor aligned to
    :data:`ALIGN` bytes)."""
    return sum(_aligned(e.nbytes) for e in entries)


def host_snapshot_bytes(engine: ZeroEngine, grid: ProcessGrid,
                        fmt: CheckpointFormat | None = None) -> int:
    """Bytes of host memory ``--async-save`` holds on this rank (the snapshot buffer, kept
    between saves) for a part in ``fmt`` (default: the default format): its ZeRO partition's
    fp32 master and two Adam moments (the default format: unpadded, 12 bytes per element it
    owns), aligned; the RNG states (a few KiB) left out. The dry run reports it."""
    fmt = fmt or format_named(DEFAULT_FORMAT)
    return snapshot_bytes(fmt.part(engine, grid, {}).entries)


def snapshot(entries: list[Entry], buffer: torch.Tensor | None,
             pin: bool) -> tuple[list[Entry], torch.Tensor]:
    """Copy every entry's tensor into one host buffer now.

    Args:
        entries: a shard's entries (their ``produce()`` reads the live training state).
        buffer: a previous snapshot's buffer (uint8, 1-D) to reuse when large enough.
        pin: allocate the buffer in pinned memory (states on a GPU).

    Returns:
        ``(entries reading the snapshot, the buffer)``.

    Raises:
        ValueError: a produced tensor's dtype or shape differs from its entry.
    """
    total = snapshot_bytes(entries)
    if buffer is None or buffer.numel() < total:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    out, offset, copied_async = [], 0, False
    for e in entries:
        t = e.produce()
        if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise ValueError(f"{e.key}: produced {t.dtype} {tuple(t.shape)}, declared {e.dtype} "
                             f"{tuple(e.shape)}")
        dst = buffer[offset:offset + e.nbytes].view(e.dtype).view(e.shape)
        copied_async |= t.device.type == "cuda"
        dst.copy_(t, non_blocking=pin and t.device.type == "cuda")
        out.append(Entry(e.key, e.dtype, e.shape, lambda d=dst: d))
        offset += _aligned(e.nbytes)
    if copied_async:
        torch.cuda.synchronize()
    return out, buffer


@dataclass
class Pending:
    """A save whose shard is being written in the background."""

    root: str
    iteration: int
    meta: dict | None
    keep: int | Retention | None
    thread: threading.Thread | None = None
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)


class AsyncSaver:
    """One job's background saves (at most one pending at a time).

    Args:
        grid: the process grid; on a CPU device the per-iteration flag is all-reduced over the
            world group, otherwise over a gloo group of every rank made here (collective: every
            rank constructs its saver at the same point).
        print_fn: rank 0's printer for the "saved" line (None: silent).
        fmt: the format it writes (``--ckpt-format``; default: the default format).
    """

    def __init__(self, grid: ProcessGrid, print_fn=None, fmt: CheckpointFormat | None = None):
        self.grid, self.print = grid, print_fn
        self.fmt = fmt or format_named(DEFAULT_FORMAT)
        self.flag_group = None if grid.device.type == "cpu" else dist.new_group(backend="gloo")
        self.pending: Pending | None = None
        self.buffer: torch.Tensor | None = None
        self.snapshot_s = 0.0
        """Seconds training waited for the last snapshot."""

    def save(self, root: str | os.PathLike, iteration: int, engine: ZeroEngine,
             train_state: dict, metadata: dict, tracker: RNGTracker | None,
             keep: int | Retention | None) -> None:
        """Wait for the pending save, snapshot this rank's part and start writing it
        (collective; arguments as :func:`hybrid.checkpoint.shards.save_checkpoint`).

        Raises:
            hybrid.checkpoint.agree.SaveFailedError: the pending save or creating the staging
                directory failed (every rank).
        """
        from hybrid.checkpoint import shards

        self.wait()
        t0 = time.perf_counter()
        stage_dir = shards.begin_save(root, iteration, self.grid)
        part = shards.rank_part(self.fmt, engine, self.grid, tracker)
        pin = self.grid.device.type == "cuda"
        entries, self.buffer = snapshot(part.entries, self.buffer, pin)
        part = dataclasses.replace(part, entries=entries)
        meta = (shards.checkpoint_metadata(engine, self.grid, train_state, metadata)
                if self.grid.rank == 0 else None)
        job = Pending(str(root), iteration, meta, keep)
        job.thread = threading.Thread(target=self._write, args=(job, stage_dir, part, self.fmt),
                                      name=f"async-save-{iteration}", daemon=True)
        job.thread.start()
        self.pending = job
        self.snapshot_s = time.perf_counter() - t0

    def reserve(self, engine: ZeroEngine, tracker: RNGTracker | None) -> None:
        """Allocate and touch the snapshot buffer now (job start), so that the first save does
        not pay for the allocation and its page faults inside the training loop."""
        from hybrid.checkpoint import shards

        total = snapshot_bytes(shards.rank_part(self.fmt, engine, self.grid, tracker).entries)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = torch.empty(total, dtype=torch.uint8,
                                      pin_memory=self.grid.device.type == "cuda")
            self.buffer.zero_()

    @staticmethod
    def _write(job: Pending, stage_dir: Path, part: RankPart, fmt: CheckpointFormat) -> None:
        from hybrid.checkpoint import shards

        try:
            shards.write_shard(stage_dir, dist.get_rank(), part, fmt)
        except BaseException as e:  # reported to every rank at publication
            job.error = e

    def poll(self) -> Path | None:
        """Publish the pending save if every rank's write has finished (collective while one
        is pending; nothing otherwise). Returns the published directory on rank 0."""
        job = self.pending
        if job is None:
            return None
        done = torch.tensor([0 if job.thread.is_alive() else 1])  # host memory: no device sync
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.flag_group)
        return self._finish() if int(done.item()) else None

    def wait(self, report: bool = True) -> Path | None:
        """Block until the pending save is written on every rank, then publish it
        (collective; nothing when none is pending); ``report`` False: no "saved" line (a stop
        prints its own)."""
        if self.pending is None:
            return None
        self.pending.thread.join()
        return self._finish(report)

    def _finish(self, report: bool = True) -> Path | None:
        from hybrid.checkpoint import shards

        job, self.pending = self.pending, None
        what = f"saving iteration {job.iteration} to {job.root} (in the background)"

        def written():
            if job.error is not None:
                raise job.error

        all_succeed(written, self.grid.device, what,
                    cleanup=shards.staging_dir(job.root, job.iteration))
        final = shards.publish_agreed(job.root, job.iteration, job.meta, self.grid, job.keep,
                                      self.fmt)
        if self.print is not None and report:
            self.print(f" saved checkpoint at iteration {job.iteration} to {job.root} (written "
                       f"in the background in {time.monotonic() - job.started:.1f} s; training "
                       f"waited {self.snapshot_s * 1e3:.0f} ms for the snapshot)")
        return final

    def abandon(self) -> None:
        """After a failure elsewhere: let the writer finish its file, publish nothing (no
        collective). The unpublished ``iter_N.tmp`` stays; the previous checkpoint is intact."""
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()
        self.pending = None
