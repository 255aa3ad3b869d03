"""Save order and ``--save-keep-last``: which checkpoints of a save directory may be deleted.

**Save order.** Iteration numbers do not order a directory's checkpoints by time: after a roll
back (``latest_checkpointed_iteration.txt`` edited to an older iteration, the usual move after
a loss spike) or a fresh run in a used directory, a newer checkpoint has a lower iteration.
So :func:`hybrid.checkpoint.directory.publish` stamps each checkpoint's ``metadata.json`` with
``save_sequence``: one more than the largest sequence in the directory at that moment (1 in an
empty one). A checkpoint's place in save order is ``(save_sequence, iteration)``; checkpoints
written before the stamp existed count as sequence 0, ordered by iteration among themselves.

**Retention.** A job that keeps the newest K checkpoints (:class:`Retention`) deletes, oldest in
save order first, only (a) checkpoints it wrote itself and (b) the checkpoint it resumed from
this directory and those before it in save order. It never deletes the checkpoint just
published (the newest in save order), nor any checkpoint newer in save order than the one it
resumed: after a roll back from 300 to 200 the abandoned 300 stays, and a fresh run (nothing
resumed from this directory) leaves every checkpoint it found alone.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybrid.checkpoint.names import iteration_dir, list_iterations

SEQUENCE_KEY = "save_sequence"


def save_order(root: str | os.PathLike) -> dict[int, tuple[int, int]]:
    """``{iteration: (save_sequence, iteration)}`` of every published checkpoint under
    ``root`` (those without a readable ``metadata.json`` are left out: a half-deleted or
    foreign directory is never ordered, hence never pruned)."""
    order = {}
    for it in list_iterations(root):
        try:
            meta = json.loads((iteration_dir(root, it) / "metadata.json").read_text())
        except (OSError, ValueError):
            continue
        order[it] = (int(meta.get(SEQUENCE_KEY, 0)), it)
    return order


def next_sequence(root: str | os.PathLike) -> int:
    """The ``save_sequence`` of the next checkpoint published under ``root``."""
    return 1 + max((seq for seq, _ in save_order(root).values()), default=0)


@dataclass(frozen=True)
class Retention:
    """``--save-keep-last``'s policy for one job.

    Attributes:
        keep: how many checkpoints to keep (at least 1).
        protected_after: save-order key of the checkpoint this job resumed from this directory
            (``(0, -1)``: none); with ``protected_upto``, checkpoints strictly between the two
            are another branch of the run and never deleted.
        protected_upto: save-order key of the newest checkpoint in the directory when the job
            started.
    """

    keep: int
    protected_after: tuple[int, int] = (0, -1)
    protected_upto: tuple[int, int] = (0, -1)

    @classmethod
    def at_start(cls, root: str | os.PathLike, keep: int, resumed: int | None) -> Retention:
        """The policy of a job saving under ``root`` that resumed iteration ``resumed`` of this
        same directory (None: it resumed nothing from it)."""
        order = save_order(root)
        newest = max(order.values(), default=(0, -1))
        after = order.get(resumed, (0, -1)) if resumed is not None else (0, -1)
        return cls(keep, after, newest)

    def protected(self, key: tuple[int, int]) -> bool:
        return self.protected_after < key <= self.protected_upto

    def doomed(self, root: str | os.PathLike) -> list[int]:
        """Iterations to delete now: the deletable ones beyond the newest ``keep`` (in save
        order) of them."""
        order = save_order(root)
        deletable = sorted(k for k in order.values() if not self.protected(k))
        return [it for _, it in deletable[:-self.keep]]

    def kept_apart(self, root: str | os.PathLike) -> list[int]:
        """Iterations never deleted by this job: newer in save order than the one resumed."""
        return sorted(it for it, k in save_order(root).items() if self.protected(k))

    def kept_apart_line(self, root: str | os.PathLike, resumed: int | None,
                        train_iters: int) -> str | None:
        """The start-up line naming what :meth:`kept_apart` protects (None: nothing), split by
        fate: the iterations this job, running from ``resumed`` (None: 0) to ``train_iters``,
        never reaches stay; those it may reach are replaced if it saves there (a save overwrites
        the same iteration, as Megatron-LM's), and the replacement is its own, pruned as such.
        """
        apart = self.kept_apart(root)
        if not apart:
            return None
        start = resumed or 0
        reached = [it for it in apart if start < it <= train_iters]
        kept = [it for it in apart if it not in reached]
        since = (f"saved after the resumed iteration {resumed}" if resumed is not None
                 else "found there by this fresh run")
        line = (f" --save-keep-last {self.keep}: {root} holds another branch of the run "
                f"({since}): iterations {apart}")
        if not reached:
            return line + " are never deleted by this job"
        protected = f"; {kept} never deleted by this job" if kept else ""
        return line + (f"{protected}; {reached} (within --train-iters {train_iters}) "
                       "overwritten if this job saves the same iteration, and then pruned as "
                       "its own")

    def prune(self, root: str | os.PathLike) -> list[int]:
        """Delete :meth:`doomed`'s checkpoints; returns their iterations."""
        doomed = self.doomed(root)
        for it in doomed:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)
        return doomed


def same_directory(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    """Whether ``a`` and ``b`` name one directory (symbolic links and ``..`` resolved)."""
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()
