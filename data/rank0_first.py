"""Run an idempotent, cached build on rank 0 first, then everywhere, without ever hanging.

Megatron-LM builds its dataset indices on rank 0 behind a bare barrier: if rank 0 dies the
others wait until the collective times out with an opaque message, and on node-local disks
the other nodes then miss the files (Megatron-LM issues #907, #795). Here:

1. global rank 0 runs ``build()`` (which writes its cache with atomic renames) while the
   other ranks wait in an all-reduce of a success flag on a dedicated gloo group whose
   timeout is ``timeout_s``;
2. if rank 0 failed, every other rank raises a RuntimeError saying so (rank 0 re-raises its
   own error); if rank 0 does not report within ``timeout_s``, a TimeoutError;
3. every other rank then runs ``build()`` too: a cache hit on shared storage, a local,
   deterministic rebuild on node-local storage (the same bytes: the build is a pure function
   of its settings, and concurrent writers of one file are safe thanks to the renames);
4. a second flag all-reduce makes every rank fail together if any rank's build failed.

Without an initialised process group (or with one rank) ``build()`` simply runs.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def _all_ok(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def run_rank0_first(build: Callable[[], T], what: str, timeout_s: float = 1800.0) -> T:
    """``build()`` on rank 0, then on the other ranks; the same result type everywhere.

    Args:
        build: idempotent, deterministic function (it must tolerate running on every rank).
        what: words for error messages, e.g. ``"GPT dataset indices under /data/cache"``.
        timeout_s: how long ranks wait for rank 0 (and for each other), in seconds.

    Raises:
        RuntimeError: the build failed on some other rank (its own error is raised there).
        TimeoutError: rank 0 (or a peer) did not report within ``timeout_s``.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    rank = dist.get_rank()
    # A gloo side group: CPU flags work under any main backend, with our own timeout.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result, error = None, None
        if rank == 0:
            try:
                result = build()
            except Exception as e:  # reported to the others below, then re-raised here
                error = e
        waiting = f"rank 0 to build {what}" if rank else f"the other ranks to take {what}"
        ok0 = _flag(error is None, group, timeout_s, waiting)
        if error is not None:
            raise error
        if not ok0:
            raise RuntimeError(f"rank 0 failed to build {what}; see rank 0's error")
        if rank != 0:
            try:
                result = build()
            except Exception as e:
                error = e
        ok = _flag(error is None, group, timeout_s, f"every rank to load {what}")
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError(f"another rank failed to load or build {what}; see its error")
        return result  # type: ignore[return-value]
    finally:
        dist.destroy_process_group(group)


def _flag(ok: bool, group, timeout_s: float, waiting_for: str) -> bool:
    try:
        return _all_ok(ok, group)
    except RuntimeError as e:  # gloo reports a timeout (or a dead peer) as RuntimeError
        raise TimeoutError(
            f"rank {dist.get_rank()}: waited up to {timeout_s:g} s for {waiting_for}; "
            f"a rank crashed or the build is slower than the timeout ({e})"
        ) from e
