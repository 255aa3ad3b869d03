"""Every rank's outcome of one step of a save, agreed before the next step.

A save is collective: every rank writes its shard, then rank 0 publishes. When one rank's
write fails (a full disk: ``OSError(ENOSPC)``), the others must not wait at a barrier for a
publication that will never come, and the half-written staging directory must not stay behind.
:func:`all_succeed` runs one step on every rank, all-reduces a failure flag (one integer per
rank: the cost of a barrier) and, only when some rank failed, gathers every rank's error, so
that every rank raises the same :class:`SaveFailedError` naming the failing ranks, the path
and the errno.
"""

from __future__ import annotations

import errno as errno_names
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


class SaveFailedError(OSError):
    """A checkpoint save failed on some rank; its staging directory was removed and the
    previous checkpoint is untouched. ``errno`` is the first failing rank's (None when that
    failure was not an ``OSError``); ``filename`` the path it failed on."""


def describe(error: BaseException | None) -> dict | None:
    """A picklable account of ``error``: its errno (and symbolic name), path and message."""
    if error is None:
        return None
    code = getattr(error, "errno", None)
    return dict(errno=code, name=errno_names.errorcode.get(code, "") if code else "",
                path=getattr(error, "filename", None), message=str(error),
                type=type(error).__name__)


def failure_message(what: str, failures: dict[int, dict], removed: Path | None) -> str:
    """One line: what failed, on which ranks, the path and errno of each, and what was done."""
    parts = []
    for rank, f in sorted(failures.items()):
        code = f" errno {f['errno']} ({f['name']})" if f["errno"] else ""
        where = f" writing {f['path']}" if f["path"] else ""
        parts.append(f"rank {rank}:{code}{where}: {f['type']}: {f['message']}")
    tail = f"; removed the partial directory {removed}" if removed is not None else ""
    return f"{what} failed ({'; '.join(parts)}){tail}; the previous checkpoint is untouched"


def all_succeed(step: Callable[[], None], device: torch.device, what: str,
                cleanup: Path | None = None) -> None:
    """Run ``step`` on every rank (collective) and raise everywhere when it failed anywhere.

    Args:
        step: this rank's part (may raise).
        device: where the flag is all-reduced (the process group's device).
        what: the step in words, for the message (``"saving iteration 6 to DIR"``).
        cleanup: a staging directory that rank 0 removes when the step failed.

    Raises:
        SaveFailedError: on every rank when ``step`` raised on any rank (chained to this rank's
            own exception, if any).
    """
    error: BaseException | None = None
    try:
        step()
    except Exception as e:  # every failure, so that no peer waits for this rank forever
        error = e
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, describe(error))
    failures = {r: f for r, f in enumerate(gathered) if f is not None}
    if cleanup is not None and dist.get_rank() == 0 and os.path.lexists(cleanup):
        shutil.rmtree(cleanup, ignore_errors=True)
    first = failures[min(failures)]
    raise SaveFailedError(first["errno"], failure_message(what, failures, cleanup),
                          first["path"]) from error
