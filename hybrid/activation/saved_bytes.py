"""Bytes saved for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves during a forward passes through the pack hook; this meter sorts
them into

- ``checkpoints``: activation checkpoints kept on the device (tagged by
  ``hybrid.activation.recompute``; their own bytes, also when they are slots of one arena);
- ``checkpoints_host``: checkpoints kept in host memory (P_a+cpu);
- ``other``: every other activation, counting the bytes of memory held, not of each saved
  view: views of one storage are merged by the byte ranges they span (``q``, ``k``, ``v`` are
  views of one ``qkv`` output and cost its bytes once; a view of one arena slot costs the slot);
- ``params``: parameters saved by reference (not activation memory, not in ``total``);
- ``total`` = ``checkpoints + other`` (device bytes held from forward to backward);
- ``recompute_peak``: the largest bytes saved while one block is recomputed in backward, i.e.
  the one block's worth of activations that full recompute still holds at a time (only when a
  backward runs inside the measurement and the handle is given).

These are the quantities of Korthikanti et al. 2022 (arXiv 2205.05198), Table 2: with full
recompute, ``2sbh`` bytes per layer in 16-bit (``4sbh`` in fp32), ``/t`` with P_a.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from hybrid.activation.recompute import CHECKPOINT_TAG

KEYS = ("checkpoints", "checkpoints_host", "other", "params", "total", "recompute_peak")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Spans:
    """Byte ranges held per storage; :meth:`total` is the size of their union."""

    def __init__(self):
        self.by_storage: dict[int, list[tuple[int, int]]] = {}

    def add(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        size = t.element_size()
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)
                         if n > 0)
        start = t.storage_offset() * size
        self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((start, start
                                                                               + extent * size))

    def total(self) -> int:
        out = 0
        for spans in self.by_storage.values():
            end = -1
            for a, b in sorted(spans):
                if b > end:
                    out += b - max(a, end)
                    end = b
        return out


def _is_param(t: torch.Tensor, param_ptrs: set[int]) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or t.untyped_storage().data_ptr() in param_ptrs


class SavedBytesMeter:
    """Context manager counting saved-for-backward bytes; see the module docstring.

    Args:
        model: its parameters are recognised (and excluded) even when saved as views.
        handle: the :class:`hybrid.activation.apply.ActivationCheckpointing` of the model, so that
            tensors saved during recompute are counted as ``recompute_peak``.
    """

    def __init__(self, model: nn.Module | None = None, handle: Any = None):
        self.param_ptrs = set() if model is None else {
            p.untyped_storage().data_ptr() for p in model.parameters()}
        self.handle = handle
        self.result = dict.fromkeys(KEYS, 0)
        self._ckpt_storages: set[int] = set()
        self._other = _Spans()
        self._recompute: _Spans | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._recompute is not None:
            if not _is_param(t, self.param_ptrs):
                self._recompute.add(t)
            return t
        tag = getattr(t, CHECKPOINT_TAG, None)
        if tag is not None:
            self.result["checkpoints_host" if tag == "host" else "checkpoints"] += _nbytes(t)
            self._ckpt_storages.add(t.untyped_storage().data_ptr())
        elif _is_param(t, self.param_ptrs):
            self.result["params"] += _nbytes(t)
        elif t.untyped_storage().data_ptr() not in self._ckpt_storages:
            self._other.add(t)
        return t

    def begin_recompute(self) -> None:
        self._recompute = _Spans()

    def end_recompute(self) -> None:
        peak = self._recompute.total() if self._recompute is not None else 0
        self.result["recompute_peak"] = max(self.result["recompute_peak"], peak)
        self._recompute = None

    def __enter__(self) -> SavedBytesMeter:
        if self.handle is not None:
            self.handle.store.meter = self
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self.handle is not None:
            self.handle.store.meter = None
        self.result["other"] = self._other.total()
        self.result["total"] = self.result["checkpoints"] + self.result["other"]


def measure_saved_bytes(fn: Callable[[], Any], model: nn.Module | None = None,
                        handle: Any = None) -> dict[str, int]:
    """Run ``fn`` (one micro-batch: forward, optionally backward) and count the bytes saved for
    backward, split as in the module docstring.

    Returns:
        ``{"checkpoints", "checkpoints_host", "other", "params", "total", "recompute_peak"}`` in
        bytes, per rank.
    """
    with SavedBytesMeter(model, handle) as meter:
        fn()
    return meter.result


def format_saved_bytes(result: dict[str, int]) -> str:
    """One human line, MiB (2^20 bytes)."""
    mib = 2.0**20
    return (f"saved for backward per micro-batch: checkpoints {result['checkpoints'] / mib:.3f} MiB"
            f" (+ host {result['checkpoints_host'] / mib:.3f} MiB) | other "
            f"{result['other'] / mib:.3f} MiB | total {result['total'] / mib:.3f} MiB | recompute "
            f"peak (one block) {result['recompute_peak'] / mib:.3f} MiB")
