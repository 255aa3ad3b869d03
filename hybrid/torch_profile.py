"""``--profile``: a ``torch.profiler`` trace of the iterations ``--profile-step-start`` to
``--profile-step-end - 1`` (1-based, as logged), on the ranks of ``--profile-ranks`` (default
all), as Megatron-LM's ``--use-pytorch-profiler`` schedule records them (``wait = start - 1,
warmup = 1, active = end - start``: ``end - start`` iterations from ``start`` on).

Each profiled rank writes one Chrome/TensorBoard trace, ``rank-<global rank>.pt.trace.json.gz``
(``rank-<r>.iterations-<first>-<last>.pt.trace.json.gz`` for a run resumed inside the window or
where that name is taken: a trace is never written over another run's),
in ``<--tensorboard-dir>/../torch_profile`` (Megatron-LM's place) or ``./torch_profile`` without
a TensorBoard directory; the name ends in ``.pt.trace.json.gz`` so that TensorBoard's PyTorch
profiler plugin lists it, and ``chrome://tracing`` or Perfetto open it. Every profiled iteration
is one ``ProfilerStep#<iteration>`` span. The iteration numbers are the run's, so a resumed run
traces the same iterations an uninterrupted one would: one resumed (``--load``) inside the window
traces the rest of it, from its first iteration on, and its line says which iterations the
window lost; one resumed after the window says that it traces nothing. (Megatron-LM's
``torch.profiler.schedule`` counts the steps of the process, so a resumed run traces other
iterations, or none.)

On CUDA without ``--use-pytorch-profiler`` the same iterations are also bracketed by
``cudaProfilerStart/Stop``, Megatron-LM's range for ``nsys --capture-range=cudaProfilerApi``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def trace_dir(tensorboard_dir: str | None) -> Path:
    """Where the traces go: ``<tensorboard_dir>/../torch_profile``, else ``./torch_profile``."""
    return (Path(os.path.normpath(Path(tensorboard_dir) / ".." / "torch_profile"))
            if tensorboard_dir else Path("torch_profile"))


def profile_notes(logging, train_iters: int | None) -> list[str]:
    """The start-up notes of a profiler flag that will trace nothing (Megatron-LM is silent):
    a window that starts after the last iteration, or --use-pytorch-profiler without --profile.
    ``logging``: the run's ``LoggingConfig``."""
    notes = []
    if logging.profile and train_iters is not None and logging.profile_step_start > train_iters:
        notes.append(f"note: --profile-step-start {logging.profile_step_start} is after the last "
                     f"iteration ({train_iters}): no trace will be written")
    if logging.use_pytorch_profiler and not logging.profile:
        notes.append("note: --use-pytorch-profiler has no effect without --profile")
    return notes


class IterationProfiler:
    """Profiles iterations ``[start, end)`` of this rank (see the module docstring).

    Args:
        start, end: the first iteration traced and the one after the last (1-based).
        rank: this process's global rank (the file name).
        directory: where the trace is written (:func:`trace_dir`).
        cuda_range: also open the ``cudaProfilerStart/Stop`` range (CUDA, no
            ``--use-pytorch-profiler``).
        print_fn: told where the trace went (None: silent).
    """

    def __init__(self, start: int, end: int, rank: int, directory: Path,
                 cuda_range: bool = False, print_fn=None):
        if not 1 <= start < end:
            raise ValueError(f"need 1 <= --profile-step-start {start} < --profile-step-end {end}")
        self.start, self.end, self.rank, self.directory = start, end, rank, Path(directory)
        self.cuda_range, self.print_fn = cuda_range, print_fn
        self._prof: torch.profiler.profile | None = None
        self._span: contextlib.AbstractContextManager | None = None
        self.path: Path | None = None
        """The trace written (None before)."""
        self.first: int | None = None
        """The first iteration this process ran (``start`` or later for a resumed run)."""
        self._last: int | None = None  # the last iteration traced to its end

    def begin(self, iteration: int) -> None:
        """Before iteration ``iteration`` (1-based) runs; the first iteration of the process
        inside ``[start, end)`` starts the trace (``start`` itself unless the run resumed past
        it)."""
        if self.first is None:
            self.first = iteration
            if iteration >= self.end and self.print_fn is not None:
                self.print_fn(f" profiler: the run resumed at iteration {iteration}, after "
                              f"--profile-step-start {self.start} .. --profile-step-end "
                              f"{self.end}: rank {self.rank} traces nothing")
        if self._prof is None and iteration == max(self.start, self.first) < self.end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
            if self.cuda_range:
                torch.cuda.profiler.start()
        if self._prof is not None:
            self._span = torch.profiler.record_function(f"ProfilerStep#{iteration}")
            self._span.__enter__()

    def end_iteration(self, iteration: int) -> None:
        """After iteration ``iteration`` (1-based) ran; the trace is written after ``end - 1``."""
        if self._prof is None:
            return
        self._span.__exit__(None, None, None)
        self._span = None
        self._last = iteration
        if iteration == self.end - 1:
            self.close()

    def close(self) -> None:
        """Stop and write the trace now (also when training stopped before ``end - 1``)."""
        if self._prof is None:
            return
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self.cuda_range:
            torch.cuda.profiler.stop()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        first = max(self.start, self.first)
        self.path = self.directory / f"rank-{self.rank}.pt.trace.json.gz"
        if first != self.start or self.path.exists():  # never over another run's trace
            last = self._last if self._last is not None else first
            self.path = self.directory / (f"rank-{self.rank}.iterations-{first}-{last}"
                                          ".pt.trace.json.gz")
        prof.export_chrome_trace(str(self.path))
        if self.print_fn is None:
            return
        lost = "" if first == self.start else (
            f"; the run resumed at iteration {first}, inside the window --profile-step-start "
            f"{self.start} .. --profile-step-end {self.end}: {_iterations(self.start, first - 1)} "
            "ran before the resume (not in the trace)")
        traced = _iterations(first, self._last) if self._last is not None else "no iteration"
        self.print_fn(f" profiler: {traced} of rank {self.rank} traced to {self.path} "
                      f"(torch.profiler, Chrome/TensorBoard format){lost}")


def _iterations(first: int, last: int) -> str:
    """``iteration 3`` or ``iterations 3-5``."""
    return f"iteration {first}" if first == last else f"iterations {first}-{last}"
