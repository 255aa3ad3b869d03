"""One job per save directory: ``DIR/save.lock``, held by the job that writes ``--save DIR``.

Two jobs saving into one directory (a duplicate submission) would each report their saves
while one silently overwrites the other's. So global rank 0 creates ``DIR/save.lock``
exclusively (a hard link, which fails when it exists) before training, holding the job's host,
pid, the pid's kernel start time, the start time (UTC) and the scheduler's job id, and removes
it at the end.
A second job finds the file and is refused before training, naming the first.

A lock is **stale**, and taken over with a note, when its job is dead:

* on this host (same host name): its pid no longer runs (or is a zombie), or runs a process
  that started at another time (the pid was reused; Linux ``/proc/<pid>/stat``);
* on another host, whose processes cannot be seen: the holder refreshes the file's
  modification time every :data:`HEARTBEAT_S` seconds from a background thread, and a lock not
  refreshed for :data:`STALE_AFTER_S` seconds is stale. A job whose host is lost thus blocks
  its directory for ten minutes at most; deleting ``save.lock`` by hand frees it at once.

The launcher (``hybrid-pretrain --nproc-per-node N``, :mod:`hybrid.job.launch`) of a one-node
job takes the lock itself before it starts torchrun, so that of two jobs started at the same
moment one is refused before any worker exists, and hands it to its rank 0: the workers get
its token in :data:`INHERIT_ENV`, and rank 0's :class:`SaveLock` replaces the launcher's record
with its own instead of refusing it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

LOCK_NAME = "save.lock"
HEARTBEAT_S = 60.0
"""Seconds between the holder's refreshes of the lock's modification time."""
STALE_AFTER_S = 600.0
"""Seconds without a refresh after which another host's lock is stale."""
INHERIT_ENV = "HYBRID_SAVE_LOCK_TOKEN"
"""Environment variable in which the launcher passes its lock's token to its workers."""


class SaveDirectoryInUseError(RuntimeError):
    """``--save`` is locked by a live job (the message names its host, pid and start time)."""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (None: no such process or
    no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def pid_start_ticks(pid: int) -> int | None:
    """The kernel start time of process ``pid`` (clock ticks after boot; None when not
    known: no such process, or no ``/proc``)."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def this_job() -> dict:
    """The record a lock holds for this process."""
    now = time.time()
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return dict(host=socket.gethostname(), pid=os.getpid(), pid_start=pid_start_ticks(os.getpid()),
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
                started_s=now, job_id=job_id, token=uuid.uuid4().hex)


def describe(holder: dict) -> str:
    """``host H, pid P, started T (job J)``."""
    job = f" (job {holder['job_id']})" if holder.get("job_id") not in (None, "none") else ""
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, started "
            f"{holder.get('started')}{job}")


def stale_reason(holder: dict, age_s: float) -> str | None:
    """Why the job of ``holder`` (a lock's record, refreshed ``age_s`` seconds ago) is dead;
    None when it may be alive."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname():
        if age_s > STALE_AFTER_S:
            return f"its lock was last refreshed {age_s:.0f} s ago (over {STALE_AFTER_S:.0f} s)"
        return None
    if not isinstance(pid, int):
        return "the lock names no pid"
    if pid == os.getpid() and holder.get("pid_start") == pid_start_ticks(pid):
        return "it is this process (an earlier run in it that did not finish)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} no longer runs on this host"
    except PermissionError:
        pass  # another user's live process
    if (_stat(pid) or ["?"])[0] in ("Z", "X"):
        return f"pid {pid} has exited (a zombie not yet reaped by its parent)"
    started = pid_start_ticks(pid)
    if started is not None and holder.get("pid_start") not in (None, started):
        return f"pid {pid} now belongs to another process (started later)"
    return None


def _read(path: Path) -> tuple[dict, float] | None:
    """``(record, seconds since its last refresh)``, or None when there is no lock."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        return json.loads(text), age
    except ValueError:  # a holder killed while writing it: a record with nothing in it
        return {}, age


def _create(path: Path, record: dict) -> bool:
    """Create ``path`` holding ``record`` unless it exists; True when created. Atomic with its
    content: the record is written beside it and hard-linked into place, so a job starting at
    the same moment never reads an empty lock (which it would take for a dead holder's)."""
    tmp = path.with_name(f"{path.name}.{record['token']}.new")
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _replace(path: Path, record: dict) -> None:
    """Put ``record`` in ``path`` at once (a reader sees the old record or the new one)."""
    tmp = path.with_name(f"{path.name}.{record['token']}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _remove_stale(path: Path, stale: dict) -> None:
    """Move the stale lock ``stale`` aside; put it back when what was moved is not it (a
    peer took it over first), then the caller's retry sees the peer's lock."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = json.loads(aside.read_text())
    except ValueError:
        moved = {}
    if moved != stale:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


class SaveLock:
    """``DIR/save.lock`` held by this process until :meth:`release`.

    Args:
        root: the ``--save`` directory (created when missing).
        inherit: the token of a lock this job's launcher holds for it (:data:`INHERIT_ENV`):
            a lock with that token is taken over as this job's own.

    Attributes:
        note: what was taken over (a stale lock: whose, and why stale); None otherwise.

    Raises:
        SaveDirectoryInUseError: a live job holds the lock (named in the message).
        OSError: ``root`` cannot be created or written.
    """

    def __init__(self, root: str | os.PathLike, inherit: str | None = None):
        self.path = Path(root) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record, self.note = this_job(), None
        for _ in range(3):
            if _create(self.path, self.record):
                break
            found = _read(self.path)
            if found is None:
                continue
            holder, age = found
            if inherit and holder.get("token") == inherit:  # our launcher's: ours now
                _replace(self.path, self.record)
                break
            reason = stale_reason(holder, age)
            if reason is None:
                raise SaveDirectoryInUseError(refusal(self.path, holder, age))
            self.note = f"took over the stale lock {self.path} of {describe(holder)}: {reason}"
            _remove_stale(self.path, holder)
        else:
            raise SaveDirectoryInUseError(f"could not lock {self.path}: other jobs keep taking it")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="save-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # removed by hand: the job goes on; the next save still works

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still this job's (idempotent)."""
        self._stop.set()
        found = _read(self.path)
        if found is not None and found[0].get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)


def in_use(root: str | os.PathLike) -> str | None:
    """The refusal (:func:`refusal`) when a live job holds ``root``'s lock, by the rules of
    :class:`SaveLock` (a stale lock does not count); None otherwise. Reads only: the launcher
    asks it before it starts torchrun, whose rank 0 then takes the lock."""
    path = Path(root) / LOCK_NAME
    found = _read(path)
    if found is None or stale_reason(*found) is not None:
        return None
    return refusal(path, *found)


def refusal(path: Path, holder: dict, age_s: float) -> str:
    """The message that refuses a second job."""
    return (f"--save {path.parent} is in use by another job: {describe(holder)} (its lock "
            f"{path} was refreshed {age_s:.0f} s ago). Two jobs saving into one directory "
            "overwrite each other's checkpoints: stop one of them, or give this job another "
            f"--save. If that job is dead and its host unreachable, delete {path} (a lock from "
            f"another host counts as stale after {STALE_AFTER_S:.0f} s without a refresh).")
