"""Graceful stops: SIGTERM (what SLURM sends before a kill) and a wall-clock limit.

The signal handler only sets a flag; the training loop asks :meth:`StopSignal.should_stop`
after each iteration, with the world's answer when the iteration's grad-norm all-reduce already
carried :meth:`StopSignal.requested` (:func:`hybrid.zero.grad_norm.global_grad_norm_and_stop`,
no extra collective or host read), else it all-reduces the flag (MAX) itself, so that every
rank stops after the same iteration, saves a checkpoint and exits 0. A signal that arrives
after the iteration's grad-norm all-reduce stops the run one iteration later.
"""

from __future__ import annotations

import os
import signal
import time


def process_start() -> float:
    """When this process started, on the :func:`time.monotonic` clock (s).

    On Linux from ``/proc/self/stat`` (the kernel's start time, so interpreter start-up and
    imports count too); elsewhere the first call of this function (``hybrid.pretrain`` calls it
    before importing torch).
    """
    global _START
    if _START is None:
        _START = time.monotonic()
        try:
            with open(f"/proc/{os.getpid()}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # s after boot
            age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
            _START -= max(0.0, age)
        except (OSError, ValueError, IndexError, AttributeError):
            pass
    return _START


_START: float | None = None


class StopSignal:
    """Tracks SIGTERM and ``--exit-duration-in-mins``.

    Args:
        exit_duration_mins: stop once this many minutes have passed since ``start`` (None: no
            limit).
        signals: which signals request a stop (default SIGTERM).
        start: :func:`time.monotonic` time the limit counts from (default: the process start,
            :func:`process_start`, so model build, data indexing and wandb start-up count).
    """

    def __init__(self, exit_duration_mins: float | None = None, signals=(signal.SIGTERM,),
                 start: float | None = None):
        self.start = process_start() if start is None else start
        self.limit_s = None if exit_duration_mins is None else 60.0 * exit_duration_mins
        self.received: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def reason(self) -> str:
        if self.received is not None:
            return f"received {signal.Signals(self.received).name}"
        return f"reached --exit-duration-in-mins ({self.limit_s / 60:g})"

    def requested(self) -> bool:
        """This rank's own answer: the signal came or the time is up (no communication)."""
        late = self.limit_s is not None and time.monotonic() - self.start >= self.limit_s
        return self.received is not None or late

    def should_stop(self, device, reduced: bool | None = None) -> bool:
        """True on every rank when any rank got the signal or ran out of time.

        Args:
            device: where the fallback all-reduce's flag lives.
            reduced: the world's OR of :meth:`requested` when a collective of this iteration
                already carried it (the grad-norm all-reduce); None: one all-reduce here.
        """
        if reduced is not None:
            return reduced
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested() else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        """Reinstall the previous handlers."""
        for s, h in self._previous.items():
            signal.signal(s, h)
