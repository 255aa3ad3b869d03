"""Run a function on a local multi-process world (gloo on CPU by default; NCCL, one GPU per rank,
when asked for).

Used by the tests (one spawn serves many checks: a 4-rank spawn of new interpreters costs ~8
CPU-s of torch imports; the tests fork their ranks from a server instead, see :func:`_context`)
and by anyone who wants a quick parallel experiment without torchrun. Production jobs launch
with ``torchrun`` instead and build the grid from its environment (``hybrid.parallel.grid``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # registers tensor reductions with ForkingPickler


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHODS = ("spawn", "forkserver")
START_METHOD_ENV = "HYBRID_SPAWN_START_METHOD"
"""Environment variable naming :func:`spawn_world`'s default start method (``spawn`` when
unset); the test suite sets ``forkserver``."""


def _context(start_method: str | None):
    """The multiprocessing context of ``start_method`` (default: :data:`START_METHOD_ENV`).

    ``forkserver``: a server process imports torch once (the first call) and each rank is
    forked from it, so a rank starts in milliseconds instead of paying the ~2 CPU-s torch
    import; the server runs nothing else, so every rank still starts from a clean interpreter.
    One difference: forked ranks share the server's string-hash seed, where spawned ones (and
    torchrun's workers) each draw their own.

    Raises:
        ValueError: an unknown start method.
    """
    method = start_method or os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"spawn_world: start method {method!r} (from {START_METHOD_ENV} or "
                         f"start_method); valid: {', '.join(START_METHODS)}")
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed"])  # before the server starts
    return mp.get_context(method)


class _CallerFd:
    """The caller's file descriptor ``fd``, sent to a forked rank (the rank's own stdout and
    stderr are the fork server's, not the caller's, e.g. pytest's capture)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _adopt, (reduction.DupFd(self.fd),)  # pickled by Process.start: sent with it


def _adopt(dup) -> int:
    return dup.detach()


def _caller_io(ctx) -> tuple[dict[str, str], tuple[_CallerFd, _CallerFd] | None]:
    """``(environment, stdout and stderr to send)`` for the ranks of ``ctx`` (no descriptors
    for spawned ranks, which inherit them); Python's buffers flushed first."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    forked = ctx.get_start_method() == "forkserver"
    return dict(os.environ), (_CallerFd(1), _CallerFd(2)) if forked else None


def _store(rank: int, world_size: int, port, timeout: datetime.timedelta):
    """The world's TCPStore: rank 0 binds a port the kernel picks (0) and publishes it in
    ``port`` (a shared ``ctx.Value``), the other ranks connect to it once published. Binding
    port 0 in the process that serves it leaves no window in which another process (another
    world started at the same moment) can take the port, as a port found free and bound later
    would.

    Raises:
        RuntimeError: rank 0 did not publish its port within ``timeout``.
    """
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        with port.get_lock():
            port.value = store.port
        return store
    end = time.monotonic() + timeout.total_seconds()
    while port.value == 0:
        if time.monotonic() > end:
            raise RuntimeError(f"spawn_world: rank 0 published no store port within {timeout}")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timeout)


def _worker(rank, world_size, port, fn, args, timeout_s, queue, backend="gloo", env=None,
            stdio=None):
    if env is not None:  # a forked rank has the server's environment: take the caller's
        os.environ.clear()
        os.environ.update(env)
    if stdio is not None:  # and its stdout and stderr
        for target, fd in zip((1, 2), stdio, strict=True):
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _store(rank, world_size, port, timeout)
        # a process group that fn destroys and initialises again (the job does, per run)
        # comes up from the environment on the same port, rank 0 serving it again
        os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        del store  # the process group holds it: destroying the group frees the port
        out = fn(rank, world_size, *args)
        # Pickle by value here (not through shared memory, whose file descriptors die with
        # this process) so that an unpicklable result is reported, not lost in the feeder thread.
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure, including asserts, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_backend(world_size: int, backend: str) -> None:
    """Raises ValueError: ``backend`` is not gloo or nccl, or nccl without one GPU per rank."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_world: backend {backend!r}; valid: 'gloo', 'nccl'")
    if backend == "nccl" and (not torch.cuda.is_available()
                              or torch.cuda.device_count() < world_size):
        raise ValueError(f"spawn_world: nccl needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs")


def spawn_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 90.0,
    join_timeout_s: float | None = None,
    backend: str = "gloo",
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; their results.

    ``fn`` must be importable (a module-level function) and its return value picklable.
    The process group is initialised before ``fn`` runs, with a collective timeout of
    ``timeout_s`` seconds so that a mismatched collective fails instead of hanging.

    The backend is gloo unless ``backend="nccl"`` (rank r then runs on ``cuda:r``): a GPU on
    the host never moves a CPU world to CUDA, and
    :func:`hybrid.parallel.grid.default_device` follows the backend (gloo: CPU).

    ``start_method`` (default :data:`START_METHOD_ENV`, else ``spawn``; :func:`_context`):
    either way a rank has the caller's environment, cwd, sys.path, stdout and stderr.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: ``backend`` is not gloo or nccl, or nccl without one GPU per rank, or an
            unknown ``start_method``.
        RuntimeError: if any rank raised (its traceback is included), or if the world did not
            finish within ``join_timeout_s`` seconds (default ``3 * timeout_s + 60``); every
            process is killed before raising.
    """
    _check_backend(world_size, backend)
    ctx = _context(start_method)
    queue = ctx.Queue()
    port = ctx.Value("i", 0)  # the store's port, published by rank 0 (:func:`_store`)
    env, stdio = _caller_io(ctx)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, timeout_s, queue,
                                          backend, env, stdio),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = join_timeout_s if join_timeout_s is not None else 3 * timeout_s + 60
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        _collect(queue, procs, deadline, results, errors)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("spawn_world: a rank failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _collect(queue, procs: list, deadline: float, results: dict[int, Any],
             errors: list[str]) -> None:
    """Fill ``results`` (rank -> value) from the ranks' reports until every rank reported or
    one failed (its traceback goes to ``errors``).

    Raises:
        RuntimeError: ``deadline`` seconds passed, or a rank died without reporting.
    """
    world_size = len(procs)
    end = time.monotonic() + deadline
    while len(results) + len(errors) < world_size:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"spawn_world: world of {world_size} did not finish within "
                               f"{deadline:.0f} s")
        try:
            rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    codes = {i: p.exitcode for i, p in enumerate(procs)}
                    raise RuntimeError(f"spawn_world: a rank died without reporting "
                                       f"(exit codes {codes})") from None
            continue
        if ok:
            results[rank] = pickle.loads(payload)  # our own child's bytes, not untrusted input
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            break
