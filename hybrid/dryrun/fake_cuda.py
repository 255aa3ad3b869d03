"""Fake CUDA devices for the dry run (``--dry-run-device cuda``) on a CPU-only machine.

The dry run (:mod:`hybrid.dryrun.dry_run`) builds and steps one rank under ``FakeTensorMode``.
With ``--dry-run-device cuda`` its tensors are fake ``cuda:LOCAL_RANK`` tensors, so a tensor
created on the wrong device (a CPU accumulator added to a GPU gradient, say) fails there as it
would on a GPU. A CPU-only torch cannot do that alone: copying into, slicing and
back-propagating CUDA fake tensors need a CUDA device guard and CUDA hooks, which it does not
register. ``fake_cuda.cpp`` (beside this file) registers a no-op guard and hooks that report 64
devices; it is built once with ``torch.utils.cpp_extension`` (a C++ compiler is needed) and
loaded *before* torch in a fresh interpreter (torch reads its CUDA hooks once, at import), which
then runs the dry run. :func:`stubs` covers what Python asks of ``torch.cuda`` (RNG states,
``set_device``, streams). Nothing is ever allocated: every tensor is fake, and
``torch.cuda.is_available()`` stays False.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

ENV = "HYBRID_FAKE_CUDA"
"""Set (to the library's path) in the interpreter that loaded the library before torch."""

PRELUDE = f"import ctypes, os, sys\nctypes.CDLL(os.environ['{ENV}'], mode=ctypes.RTLD_GLOBAL)\n"
"""Python that loads the library; run it before ``import torch``."""


def library() -> str:
    """The fake-CUDA library's path, built on first use (cached by ``torch.utils.cpp_extension``
    under ``TORCH_EXTENSIONS_DIR``).

    Raises:
        RuntimeError: a torch built with CUDA (its own CUDA guard and hooks are registered; run
            on the GPU, or use ``--dry-run-device cpu``), no C++ compiler, or the build failed
            (the compiler's message included).
    """
    import shutil

    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is not None:
        raise RuntimeError(f"--dry-run-device cuda fakes CUDA on a CPU-only torch; this torch "
                           f"({torch.__version__}) is built with CUDA {torch.version.cuda}: run "
                           "the job on the GPU, or use --dry-run-device cpu")

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise RuntimeError("--dry-run-device cuda builds a small C++ extension: no C++ compiler "
                           "(c++, g++ or clang++) found; install one or use --dry-run-device cpu")
    src = Path(__file__).with_name("fake_cuda.cpp")
    return cpp_extension.load("hybrid_fake_cuda", [str(src)], is_python_module=False,
                              verbose=False)


def loaded() -> bool:
    """Whether this interpreter loaded the library before torch."""
    return bool(os.environ.get(ENV))


def run_preloaded(argv: list[str], code: str = "") -> int:
    """Run the dry run of ``hybrid.pretrain`` flags ``argv`` (:func:`hybrid.dryrun.report.main`)
    in a fresh interpreter that loads the library first; ``code`` runs after it (tests plant
    faults there). Returns the exit status. The interpreter catches SIGTERM / SIGINT as
    ``hybrid.pretrain`` does (the dry run stops at its next phase boundary), and this process
    passes on those it receives (a ``kill`` of the command's pid reaches the dry run; a
    terminal's Ctrl-C reaches both, counted once)."""
    import signal

    catch = "from hybrid.job.preemption import catch_stops_early\ncatch_stops_early()\n"
    cmd, env = preloaded_command(catch + code + "\nfrom hybrid.dryrun.report import main\n",
                                 argv)
    proc = subprocess.Popen(cmd, env=env)
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def preloaded_command(program: str, argv: list[str]) -> tuple[list[str], dict]:
    """``(command, environment)`` of a fresh interpreter that loads the library before torch,
    then runs ``program`` (which defines ``main``) and exits with ``main(argv)``.

    Raises:
        RuntimeError: as :func:`library` (the library cannot be built here).
    """
    import torch

    lib = library()
    torch_lib = str(Path(torch.__file__).parent / "lib")
    env = dict(os.environ, **{ENV: lib})
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)
    code = PRELUDE + program + "\nsys.exit(main(sys.argv[1:]))\n"
    return [sys.executable, "-c", code, *argv], env


class _Event:
    """A CUDA event that orders nothing (the dry run executes nothing)."""

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Stream:
    """A CUDA stream that orders nothing (the dry run executes nothing)."""

    def __init__(self, device=None, priority=0):
        self.device = device

    def record_event(self, event=None):
        return event or _Event()

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


@contextlib.contextmanager
def stubs():
    """``torch.cuda``'s Python side for fake devices: per-device RNG states (real host
    tensors, as generators need), ``manual_seed``, ``set_device``/``device``, streams and events
    that order nothing (the dry run executes nothing)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    current, states = [0], {}

    def index(device=None) -> int:
        d = torch.device("cuda", current[0]) if device is None else torch.device(device)
        return current[0] if d.index is None else d.index

    def get_state(device="cuda"):
        with unset_fake_temporarily():
            return states.setdefault(index(device), torch.zeros(16, dtype=torch.uint8)).clone()

    def set_state(state, device="cuda"):
        with unset_fake_temporarily():
            states[index(device)] = state.clone()

    def seed(s):
        with unset_fake_temporarily():
            states[current[0]] = torch.tensor([s % 256] + [0] * 15, dtype=torch.uint8)

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], index(d)
        try:
            yield
        finally:
            current[0] = before

    fakes = dict(get_rng_state=get_state, set_rng_state=set_state, manual_seed=seed,
                 manual_seed_all=seed, set_device=lambda d: current.__setitem__(0, index(d)),
                 current_device=lambda: current[0], device_count=lambda: 64, device=device,
                 Stream=_Stream, Event=_Event, current_stream=lambda device=None: _Stream(device),
                 stream=lambda s: contextlib.nullcontext(), synchronize=lambda device=None: None)
    with contextlib.ExitStack() as stack:
        for name, fn in fakes.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, fn))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream",
                                              lambda self, stream: None))
        yield


def _where() -> str:
    """The innermost source line of this repository on the stack (outside the dry run)."""
    import traceback

    root = str(Path(__file__).resolve().parents[2])
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if (f.startswith(root) and "site-packages" not in f
                and not f.endswith(("fake_cuda.py", "dry_run.py"))):
            return f"{os.path.relpath(f, root)}:{frame.lineno}"
    return "?"


def transfer_log():
    """A dispatch mode recording host<->device copies (``copies``) and ``.item()`` reads of
    device tensors (``reads``) with the source line that caused each; :meth:`note_read` adds
    other reads."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class TransferLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies: list[str] = []
            self.reads: list[str] = []

        def note_read(self, what: str) -> None:
            self.reads.append(f"{what} at {_where()}")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("_to_copy", "copy_"):
                src = args[1] if name == "copy_" else args[0]
                dst = args[0] if name == "copy_" else out
                if (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                        and src.device.type != dst.device.type):
                    self.copies.append(f"{src.device.type}->{dst.device.type} "
                                       f"{list(src.shape)} {src.dtype} at {_where()}")
            elif name == "_local_scalar_dense" and args[0].device.type != "cpu":
                self.note_read(".item()")  # of a device tensor (a host tensor's is no sync)
            return out

    return TransferLog()


def summarize(lines: list[str]) -> list[str]:
    """``lines`` counted: ``"3 x line"``, in first-seen order."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [f"{n} x {line}" for line, n in counts.items()]
