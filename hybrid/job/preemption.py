"""Graceful stops: SIGTERM (what SLURM sends before a kill), SIGINT (Ctrl-C) and a wall-clock
limit.

The signal handler only sets a flag; the training loop asks :meth:`StopSignal.should_stop`
after each iteration, with the world's answer when the iteration's grad-norm all-reduce already
carried :meth:`StopSignal.requested` (:func:`hybrid.zero.grad_norm.global_grad_norm_and_stop`,
no extra collective or host read), else it all-reduces the flag (MAX) itself, so that every
rank stops after the same iteration, saves a checkpoint and exits 0. A signal that arrives
after the iteration's grad-norm all-reduce stops the run one iteration later.

A second SIGINT (more than :data:`REPEAT_S` after the first) ends the process at once (exit
status 130) with one line and without saving.
A stop that arrives while the job starts (:func:`catch_stops_early`, before the loop's handler
exists) is kept and honoured after the first iteration. A torchrun worker also stops (as on
SIGTERM once training is under way, SIGKILL while it starts) when torchrun dies
(:func:`stop_with_parent`).
"""

from __future__ import annotations

import os
import signal
import sys
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
# (signal, monotonic time) caught by catch_stops_early() that no StopSignal took yet
_EARLY: list[tuple[int, float]] = []


def catch_stops_early() -> None:
    """From now on, record SIGTERM / SIGINT for the :class:`StopSignal` built later (the
    process entry point calls it, before the slow imports; a second SIGINT exits at once).
    This module imports nothing beyond what the interpreter has loaded (``signal`` aside), so
    the entry point catches a stop a few ms after the interpreter's own start-up; before that
    (Python starting, no line of this package run yet) SIGTERM ends the process by its default
    action (status 143) with nothing started."""
    def record(signum, frame):
        now = time.monotonic()
        last = max((t for s, t in _EARLY if s == signal.SIGINT), default=-REPEAT_S)
        if signum != signal.SIGINT or now - last > REPEAT_S:  # else: the same Ctrl-C again
            _EARLY.append((signum, now))
        if [s for s, _ in _EARLY].count(signal.SIGINT) > 1:
            _exit_interrupted()

    for s in STOP_SIGNALS:
        signal.signal(s, record)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: nothing to save yet
        stop_with_parent(signal.SIGKILL)


def early_stop() -> int | None:
    """The first stop signal :func:`catch_stops_early` recorded that no :class:`StopSignal`
    took yet (None: none); it stays recorded."""
    return _EARLY[0][0] if _EARLY else None


def _parent_is_torchrun(ppid: int) -> bool:
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            return b"torch" in f.read()  # torchrun, python -m torch.distributed.run
    except OSError:
        return False


def stop_with_parent(signum: int = signal.SIGTERM) -> None:
    """Linux: the kernel sends this process ``signum`` when its parent (torchrun) dies
    (``prctl(PR_SET_PDEATHSIG)``). The entry point asks for SIGKILL: while the worker starts
    (blocked in the process group's rendezvous, building the model) there is nothing to save
    and a Python handler may not run for minutes. The training loop's :class:`StopSignal` then
    asks for SIGTERM, so a worker whose launcher and torchrun were SIGKILLed stops as on
    SIGTERM (finishes its iteration, saves, exits 0) instead of training on orphaned. A parent
    that died before this call (the worker was re-parented to init or a subreaper, which is not
    torchrun) sends ``signum`` at once. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # here: the entry point imports this module before it catches a stop

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or not _parent_is_torchrun(parent):
        os.kill(os.getpid(), signum)


def _exit_interrupted() -> None:
    """A second Ctrl-C: end now, one line from rank 0 (the others end silently)."""
    if os.environ.get("RANK", "0") == "0":
        # true whether the stop's save is in progress, done, or never started
        os.write(2, b"hybrid-pretrain: second interrupt: exiting now; a save in progress is "
                    b"abandoned, every completed checkpoint stays\n")
    os._exit(130)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 1.0  # a SIGINT this soon after the last one is the same Ctrl-C, delivered twice


class StopSignal:
    """Tracks SIGTERM, SIGINT and ``--exit-duration-in-mins``.

    Args:
        exit_duration_mins: stop once this many minutes have passed since ``start`` (None: no
            limit).
        signals: which signals request a stop (default SIGTERM and SIGINT; a second SIGINT
            exits at once). A stop that :func:`catch_stops_early` recorded counts as received.
        start: :func:`time.monotonic` time the limit counts from (default: the process start,
            :func:`process_start`, so model build, data indexing and wandb start-up count).
    """

    def __init__(self, exit_duration_mins: float | None = None, signals=STOP_SIGNALS,
                 start: float | None = None):
        self.start = process_start() if start is None else start
        self.limit_s = None if exit_duration_mins is None else 60.0 * exit_duration_mins
        early = [(s, t) for s, t in _EARLY if s in signals]
        _EARLY.clear()
        self.received: int | None = early[0][0] if early else None
        interrupts = [t for s, t in early if s == signal.SIGINT]
        self.interrupts = len(interrupts)
        self._last_interrupt = interrupts[-1] if interrupts else -REPEAT_S
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        if "TORCHELASTIC_RUN_ID" in os.environ and signal.SIGTERM in signals:
            stop_with_parent(signal.SIGTERM)  # from now on a dead torchrun means: save, stop

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            # the same Ctrl-C twice (SLURM's srun delivers it, torchrun forwards it) is one
            if now - self._last_interrupt > REPEAT_S:
                self.interrupts += 1
            self._last_interrupt = now
            if self.interrupts > 1:
                _exit_interrupted()
        if self.received is None:
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
