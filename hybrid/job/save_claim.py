"""``--save``'s lock when the launcher starts the job (``hybrid-pretrain --nproc-per-node N``,
:mod:`hybrid.job.launch`; the lock itself: :mod:`hybrid.checkpoint.lock`).

One node: the launcher takes the lock before it starts torchrun and hands it to rank 0 (its
token in :data:`hybrid.checkpoint.lock.INHERIT_ENV`), so of two jobs started at the same moment
on one directory the second is refused by its launcher, one line and exit status 2, before any
worker exists. Several nodes (rank 0 may start on any of them): each launcher only reads the
lock by the same rules, and rank 0 takes it.

A refusal inside the workers (a job that took the lock in between) reaches the launcher through
a file named in :data:`REFUSAL_ENV` (:func:`refused_in_worker`): the workers exit 0, so that
torchrun prints no failure report (it reports any non-zero exit, then exits 1), and the launcher
prints the one line and exits 2, as every refusal before training.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from hybrid.checkpoint.lock import INHERIT_ENV, SaveDirectoryInUseError, SaveLock, in_use

REFUSAL_ENV = "HYBRID_REFUSAL_FILE"
"""Environment variable naming the file in which workers leave a refusal for their launcher."""


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


@contextlib.contextmanager
def worker_env(lock: SaveLock | None):
    """``(environment for torchrun's workers, refused)`` while torchrun runs: the lock's token
    (:data:`INHERIT_ENV`) and a fresh refusal file (:data:`REFUSAL_ENV`, removed on leaving);
    ``refused()`` returns what the workers left there ("" when nothing)."""
    fd, path = tempfile.mkstemp(prefix="hybrid-refusal-")
    os.close(fd)
    env = {REFUSAL_ENV: path, **({INHERIT_ENV: lock.record["token"]} if lock else {})}

    def refused() -> str:
        with open(path) as f:
            return f.read()

    try:
        yield env, refused
    finally:
        os.unlink(path)


def refused_in_worker(message: str, rank: int) -> int:
    """A worker's exit status for a job refused before training (``message``: why; ``rank``:
    the global rank). Under the launcher (:data:`REFUSAL_ENV` set) local rank 0 leaves
    ``message`` in that file and every worker exits 0; otherwise (torchrun alone, or one
    process) global rank 0 prints the line and each exits 2."""
    path = os.environ.get(REFUSAL_ENV)
    if path is None:
        if rank == 0:
            print(f"hybrid-pretrain: error: {message}", file=sys.stderr, flush=True)
        return 2
    if os.environ.get("LOCAL_RANK", "0") == "0":
        with open(path, "w") as f:
            f.write(message)
    return 0
