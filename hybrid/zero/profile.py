"""Per-phase wall-clock profile of a training step (issue: where do the milliseconds go).

A :class:`PhaseTimer` attached with ``ZeroEngine.set_profiler`` splits each step into
*exclusive* phases: time spent in a phase nested inside another (a gradient hook inside
backward, a collective wait inside a hook) counts for the inner phase only, so the phases of a
step add up to its wall time. The engine reports:

============  ================================================================================
phase         what is timed
============  ================================================================================
forward       the caller's forward (``timer.phase("forward")``), minus what is nested in it
backward      autograd's backward compute, minus hooks, copies and waits inside it
hooks         Python in the post-accumulate-grad hooks and the stage-3 gather hooks
copies        gradient accumulation into the fp32 buffer and bucket staging copies in/out
grad_comm     issuing and waiting for gradient reductions (all-reduce / reduce-scatter)
param_gather  stage 3: issuing and waiting for parameter all-gathers in forward and backward
grad_norm     the global gradient norm and overflow check (one small world all-reduce)
optimizer     AdamW on the owned fp32 partition (and clipping)
refresh       copying the updated master into the compute parameters (all-gather for 1-3)
zeroing       clearing the gradient buffer after the step
============  ================================================================================

On a CUDA device every boundary synchronises the device, so a profiled step is slower than an
unprofiled one and the split is of device time as seen by the host; leave it off for
throughput runs. Units: seconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

PHASES = ("forward", "backward", "hooks", "copies", "grad_comm", "param_gather", "grad_norm",
          "d2h_wait", "optimizer", "host_step", "refresh", "zeroing")
"""Every phase the engine and the training loop report, in step order (``d2h_wait``: waiting
for the offloaded gradients' host copies; ``host_step``: the host AdamW of
``--optimizer-cpu-offload``)."""

_NULL = nullcontext()


class NullTimer:
    """The default: every ``phase`` is a shared no-op context (no clock read)."""

    enabled = False

    def phase(self, name: str):
        return _NULL


NULL_TIMER = NullTimer()


class PhaseTimer:
    """Exclusive wall time per named phase, accumulated over steps.

    Args:
        device: the training device; on CUDA each phase boundary calls
            ``torch.cuda.synchronize`` so device work is charged to the phase that issued it.
    """

    enabled = True

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._last = 0.0
        self.steps = 0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        """Charge the time until exit (less nested phases) to ``name``."""
        t = self._now()
        if self._stack:
            self.totals[self._stack[-1]] += t - self._last
        self._stack.append(name)
        self._last = t
        try:
            yield
        finally:
            t = self._now()
            self.totals[self._stack.pop()] += t - self._last
            self._last = t

    def end_step(self) -> None:
        """Count one finished step (the divisor of :meth:`per_step_ms`)."""
        self.steps += 1

    def reset(self) -> None:
        """Forget everything measured (after warm-up steps)."""
        self.totals.clear()
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """``{phase: ms per step}`` for every phase in :data:`PHASES` plus any other name used,
        averaged over the steps counted by :meth:`end_step`."""
        n = max(1, self.steps)
        names = list(PHASES) + sorted(set(self.totals) - set(PHASES))
        return {k: 1e3 * self.totals.get(k, 0.0) / n for k in names}


def format_profile(rows: dict[str, dict[str, float]]) -> list[str]:
    """A markdown table, one row per configuration: ms per step in each phase, and the sum.

    Args:
        rows: ``{config name: per_step_ms() of its rank 0}``.
    """
    names = [p for p in PHASES if any(r.get(p, 0.0) > 0.0 for r in rows.values())]
    out = ["| config | " + " | ".join(names) + " | sum |", "|---|" + "---|" * (len(names) + 1)]
    for cfg, r in rows.items():
        out.append(f"| {cfg} | " + " | ".join(f"{r.get(p, 0.0):.1f}" for p in names)
                   + f" | {sum(r.values()):.1f} |")
    return out
