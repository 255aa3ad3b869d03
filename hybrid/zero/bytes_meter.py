"""Bytes the ZeRO engine moves through memory outside its collectives (issue 33's figure: what
gradient accumulation and bucket staging cost per micro-batch, and what fusion removes).

:class:`EngineBytes` is a ``TorchDispatchMode``: while active it sees every ATen op and counts
those that read or write one of the engine's gradient buffers (the flat gradient, the
partition, the staging inputs, outputs and scratch), which covers the engine's own copies,
scalings and accumulations, and autograd's in-place accumulation into a fused ``p.grad`` view
(the work the engine delegates to it). Ops inside a data-parallel collective (a
:class:`hybrid.zero.comm.DPComm` call or the wait of its work, e.g. gloo's composed
reduce-scatter summing the received chunks) are the collective's, not counted; views move
nothing.

Bytes per op, from the tensors themselves: every input read plus every output written; an
operand that is only written (``copy_``/``zero_``/``fill_``'s destination, an ``out=``) is
counted once, as a write; an in-place op's operand counts as read and written. A GEMM that
accumulates into a buffer (the fused weight-gradient GEMM, :mod:`hybrid.parallel.linear.gemm`)
counts only the buffer, read and written: its operands are read by the GEMM with or without
fusion.
Units: bytes.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid.zero import comm as comm_module

WRITE_ONLY = {"copy_", "zero_", "fill_", "_foreach_copy_", "_foreach_zero_"}
"""Ops whose first operand is only written."""
GEMMS = {"addmm", "addmm_", "mm", "matmul"}
"""GEMMs: only their operands in the engine's buffers are counted (module docstring)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class EngineBytes(TorchDispatchMode):
    """Count bytes of ops touching ``buffers`` (tensors; storage identity decides).

    Attributes:
        by_op: ``{op name: bytes}`` since the last :meth:`reset`.
    """

    def __init__(self, buffers: list[torch.Tensor]):
        super().__init__()
        self.storages = {b.untyped_storage().data_ptr() for b in buffers if b.numel()}
        self.by_op: Counter = Counter()
        self.in_collective = 0

    def reset(self) -> None:
        self.by_op.clear()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def _touches(self, tensors) -> bool:
        return any(t.untyped_storage().data_ptr() in self.storages for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.in_collective or func.is_view:
            return out
        name = func.overloadpacket.__name__
        first, rest = (args[0], args[1:]) if args else (None, ())
        firsts = [t for t in tree_flatten(first)[0] if isinstance(t, torch.Tensor)]
        others = [t for t in tree_flatten((rest, {k: v for k, v in kwargs.items()
                                                  if k != "out"}))[0]
                  if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(kwargs.get("out", out))[0] if isinstance(t, torch.Tensor)]
        if not self._touches(firsts + others + outs):
            return out
        in_place = name.endswith("_")
        written = firsts if in_place and not outs else outs
        read = others + ([] if name in WRITE_ONLY else firsts)
        if name in GEMMS:
            read, written = ([t for t in ts if self._touches([t])] for ts in (read, written))
        self.by_op[name] += sum(map(_nbytes, read)) + sum(map(_nbytes, written))
        return out


@contextmanager
def collectives_uncounted(meter: EngineBytes):
    """While active, ops inside ``DPComm`` collectives and their waits are not counted."""
    cls, work = comm_module.DPComm, comm_module.Work
    saved = {name: getattr(cls, name) for name in ("all_reduce", "reduce_scatter", "all_gather")}
    saved_wait = work.wait

    def wrap(fn):
        def call(*a, **k):
            meter.in_collective += 1
            try:
                return fn(*a, **k)
            finally:
                meter.in_collective -= 1
        return call

    for name, fn in saved.items():
        setattr(cls, name, wrap(fn))
    work.wait = wrap(saved_wait)
    try:
        yield meter
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
        work.wait = saved_wait


def engine_buffers(engine) -> list[torch.Tensor]:
    """The engine's gradient buffers: the flat gradient or partition and the staging tensors."""
    return [engine.reducer.buffer] + [t for group in engine.reducer.staging for t in group]
