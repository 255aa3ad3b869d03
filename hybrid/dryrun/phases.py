"""The dry run's phases (build, each forward and backward, the step, the save): each timed and
reported as it ends, and the boundary where a stop (SIGTERM, Ctrl-C) ends the dry run."""

from __future__ import annotations

import time


class DryRunStopped(Exception):
    """SIGTERM or Ctrl-C came during the dry run: it stopped at the end of phase ``phase``
    (``signal``: the signal's name); :meth:`line` is what the command prints."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(f"{signal_name} after phase {phase}")
        self.signal, self.phase = signal_name, phase

    def line(self) -> str:
        return (f"dry run stopped after phase {self.phase}: received {self.signal}; no report "
                "(the step did not finish)")


def stop_requested() -> str | None:
    """The name of the stop signal the entry point caught (``hybrid.job.preemption``'s early
    catcher; the dry run has no training loop to hand it to), or None."""
    import signal

    from hybrid.job.preemption import early_stop

    return None if early_stop() is None else signal.Signals(early_stop()).name


class PhaseClock:
    """Times the dry run's phases and reports each as it ends: ``progress(line)`` with the
    phase's name and its seconds (wall clock), e.g. ``dry run phase: backward (micro-batch
    1/1) 41.2 s``. ``phases`` keeps ``[(name, seconds)]`` in order. A stop (SIGTERM, Ctrl-C:
    ``stop()`` names it) ends the dry run at the next phase boundary: :class:`DryRunStopped`
    (a 405B rank's backward takes minutes, and a stop was ignored until the step ended)."""

    def __init__(self, progress=None, stop=stop_requested) -> None:
        self.progress, self.stop = progress, stop
        self.phases: list[tuple[str, float]] = []

    def done(self, name: str, seconds: float, last: bool = False) -> None:
        """Record phase ``name`` that took ``seconds`` and report it; then, unless it is the
        ``last`` (the report follows at once), stop if asked.

        Raises:
            DryRunStopped: a stop signal came.
        """
        self.phases.append((name, seconds))
        if self.progress is not None:
            self.progress(f"dry run phase: {name} {seconds:.1f} s")
        if not last and (signal_name := self.stop()) is not None:
            raise DryRunStopped(signal_name, name)

    def timed(self, fn, name):
        """``fn`` wrapped to report ``name(call)`` (a callable of the call's index) when it
        returns."""
        calls = [0]

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            calls[0] += 1
            self.done(name(calls[0]), time.perf_counter() - t)
            return out

        return wrapper
