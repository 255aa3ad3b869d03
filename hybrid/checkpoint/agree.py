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
    failure was not an ``OSError``); ``filename`` the path it failed on. ``str()`` is the one
    line of :func:`failure_message` (not ``OSError``'s ``[Errno N] ...: 'path'``)."""

    def __str__(self) -> str:
        return str(self.strerror)


def describe(error: BaseException | None) -> dict | None:
    """A picklable account of ``error``: its errno (and symbolic name), path, reason (the
    ``strerror`` of an ``OSError``, else the message), type, and ``needed``: the bytes the file
    being written needed (``needed_bytes``, set by the shard writer; None when unknown)."""
    if error is None:
        return None
    code = getattr(error, "errno", None)
    reason = getattr(error, "strerror", None) if code else None
    return dict(errno=code, name=errno_names.errorcode.get(code, "") if code else "",
                path=getattr(error, "filename", None), reason=reason or str(error),
                type=type(error).__name__, needed=getattr(error, "needed_bytes", None))


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 1`` or ``ranks 0, 1, 2, ... (512 ranks)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:4]))
    return f"ranks {shown}" + (f", ... ({len(ranks)} ranks)" if len(ranks) > 4 else "")


def failure_message(what: str, failures: dict[int, dict], removed: Path | None,
                    staging: Path | None = None) -> str:
    """One line: what failed; per kind of failure the ranks, the errno, the first rank's path
    and the bytes those ranks' files needed; what was removed; and that the previous checkpoint
    (the iteration the save directory's pointer names) is intact. Ranks failing alike are one
    entry, so a thousand ranks on one full file system stay one short line. ``staging``: the
    save's staging directory (its parent is the save directory; default ``removed``)."""
    groups: dict[tuple, list[int]] = {}
    for rank, f in sorted(failures.items()):
        groups.setdefault((f["errno"], f["name"], f["type"], f["reason"]), []).append(rank)
    parts = []
    for (code, name, kind, reason), ranks in groups.items():
        path = failures[ranks[0]]["path"]
        where = f" writing {path}" if path else ""
        if where and len(ranks) > 1:
            where += " (and the other ranks' files beside it)"
        line = (f"{_ranks(ranks)}: errno {code} ({name}){where}: {reason}" if code
                else f"{_ranks(ranks)}:{where} {kind}: {reason}")
        needed = [failures[r]["needed"] for r in ranks]
        if all(n is not None for n in needed):
            whose = "its file needs" if len(ranks) == 1 else "their files need"
            line += f"; {whose} {sum(needed):,} bytes"
        parts.append(line)
    tail = f"; removed the partial directory {removed}" if removed is not None else ""
    return f"{what} failed ({'; '.join(parts)}){tail}; {_previous(staging or removed)}"


def _previous(staging: Path | None) -> str:
    """``the previous checkpoint (iteration 4) is intact``, read from the pointer of the save
    directory that holds ``staging``."""
    if staging is None:
        return "the previous checkpoint is intact"
    from hybrid.checkpoint.published import IncompleteCheckpointError, latest_iteration

    try:
        latest = latest_iteration(staging.parent)
    except (IncompleteCheckpointError, OSError):
        latest = None
    if latest is None:
        return f"no earlier checkpoint is published in {staging.parent}"
    return f"the previous checkpoint (iteration {latest} in {staging.parent}) is intact"


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
    # rank 0 removes the staging directory; it says whether there was one (a failed publication
    # may have renamed it already), so that every rank's message is the same
    staged = cleanup is not None and dist.get_rank() == 0 and os.path.lexists(cleanup)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (describe(error), staged))
    failures = {r: f for r, (f, _) in enumerate(gathered) if f is not None}
    if staged:
        shutil.rmtree(cleanup, ignore_errors=True)
    first = failures[min(failures)]
    message = failure_message(what, failures, cleanup if gathered[0][1] else None, cleanup)
    raise SaveFailedError(first["errno"], message, first["path"]) from error
