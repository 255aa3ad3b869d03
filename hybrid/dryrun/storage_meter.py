"""Bytes of the tensor storages alive while code runs, and their peak (:class:`StorageMeter`):
the dry run's memory meter (:mod:`hybrid.dryrun.dry_run`), at O(1) cost per op."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageMeter(TorchDispatchMode):
    """Bytes of the tensor storages that are alive, and their peak, at O(1) cost per op.

    Every output of every op dispatched while the meter is active (and every tensor passed to
    :meth:`track`) has its storage recorded with a weak reference: the bytes are added when the
    storage is first seen and removed when it is freed; ``UntypedStorage.resize_`` (stage 3's
    release and re-gather of a unit) is followed too. Meta tensors (the model's shapes before
    construction) are not counted. Same counting rule as torch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (no CUDA rounding: the dry run has no
    device), without its per-module snapshots, whose cost grows with ops x modules and makes a
    125-layer step take tens of minutes.

    Args:
        skip_cpu: leave CPU storages out (on fake CUDA with ``--optimizer-cpu-offload``: the
            host master, moments, gradient copy and the host step's temporaries are host
            memory, not the device's).

    Attributes:
        current: bytes alive now (int).
        peak: the largest ``current`` seen since construction or :meth:`reset_peak` (int).
    """

    def __init__(self, skip_cpu: bool = False) -> None:
        super().__init__()
        self.skip_cpu = skip_cpu
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes]
        self._orig_resize = None

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors allocated before the meter was entered."""
        for t in tensors:
            self._see(t)

    def reset_peak(self) -> None:
        """Start a new peak at the bytes alive now."""
        self.peak = self.current

    def _see(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or (
                self.skip_cpu and t.device.type == "cpu"):
            return
        st = t.untyped_storage()
        entry = self._live.get(id(st))
        if entry is None:
            key = id(st)
            self._live[key] = [weakref.ref(st, lambda _, k=key: self._freed(k)), 0]
            entry = self._live[key]
        self._resized(entry, st.nbytes())

    def _resized(self, entry: list, nbytes: int) -> None:
        self.current += nbytes - entry[1]
        entry[1] = nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __enter__(self):
        self._orig_resize = orig = torch.UntypedStorage.resize_
        meter = self

        def resize_(st, size):
            out = orig(st, size)
            entry = meter._live.get(id(st))
            if entry is not None:
                meter._resized(entry, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._see(t)
        return out
