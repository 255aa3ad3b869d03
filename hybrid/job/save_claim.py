"""``--save``'s lock when the launcher starts the job (``hybrid-pretrain --nproc-per-node N``,
:mod:`hybrid.job.launch`; the lock itself: :mod:`hybrid.checkpoint.lock`).

One node: the launcher takes the lock before it starts torchrun and hands it to rank 0 (its
token in :data:`hybrid.checkpoint.lock.INHERIT_ENV`), so of two jobs started at the same moment
on one directory the second is refused by its launcher, one line and exit status 2, before any
worker exists. Several nodes (rank 0 may start on any of them): each launcher only reads the
lock by the same rules, and rank 0 takes it.

A refusal inside the workers (a job that took the lock in between) is reported like every
failure the job reports itself: rank 0 prints the one line and the workers hand status 2 to the
launcher (:func:`hybrid.job.launch.worker_status`), so torchrun prints no failure report.
"""

from __future__ import annotations

from hybrid.checkpoint.lock import INHERIT_ENV, SaveDirectoryInUseError, SaveLock, in_use


def hold_save(save: str | None, one_node: bool) -> SaveLock | None:
    """The launcher's part before torchrun starts: on ``one_node`` take ``save``'s lock (a note
    when it took over a dead job's), to be handed to rank 0; on several nodes only check that no
    live job holds it. Returns the lock taken (None: no ``--save``, or several nodes).

    Raises:
        SaveDirectoryInUseError: a live job holds it (the message names the job).
        OSError: the directory cannot be created or written.
    """
    if not save:
        return None
    if not one_node:
        if why := in_use(save):
            raise SaveDirectoryInUseError(why)
        return None
    lock = SaveLock(save)
    if lock.note:
        print(f"hybrid-pretrain: --save {save}: {lock.note}", flush=True)
    return lock


def worker_env(lock: SaveLock | None) -> dict[str, str]:
    """The environment torchrun's workers need for ``lock``: its token (:data:`INHERIT_ENV`),
    by which rank 0 takes it over; nothing without a lock."""
    return {INHERIT_ENV: lock.record["token"]} if lock else {}
