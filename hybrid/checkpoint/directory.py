"""Checkpoint directories, in any format: atomic publication, retention, the "latest" pointer.

Layout under ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     the newest *complete* iteration (Megatron's name)
    DIR/iter_0000500/metadata.json            grid, ZeRO stage, config, iteration, files, format
    DIR/iter_0000500/rank_00003.safetensors   the format's files (the default: a shard per rank)
    DIR/iter_0000600.tmp/...                  a save in progress (never loaded)

Protocol: every rank writes its files into ``iter_N.tmp``, each under a temporary
name renamed when complete; after a barrier, rank 0 checks the format's files are all there,
writes ``metadata.json`` (listing them, and naming the format), renames the directory to
``iter_N``, then replaces the pointer file atomically and only then deletes checkpoints beyond
the newest ``keep`` in save order (:mod:`hybrid.checkpoint.retention`: never the one just
published). A process killed anywhere in this sequence leaves the previous complete checkpoint
in place and pointed to. Reading what is published: :mod:`hybrid.checkpoint.published`; the
files themselves: the format's (:mod:`hybrid.checkpoint.format`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid.checkpoint.names import iteration_dir, list_iterations
from hybrid.checkpoint.published import (
    POINTER,
    IncompleteCheckpointError,
    iteration_of_dir,
    latest_iteration,
    read_metadata,
)
from hybrid.checkpoint.registry import DEFAULT_FORMAT, format_named
from hybrid.checkpoint.retention import SEQUENCE_KEY, Retention, next_sequence
from hybrid.checkpoint.safetensors_format import FORMAT_VERSION, shard_name

if TYPE_CHECKING:
    from hybrid.checkpoint.format import CheckpointFormat

# the read side and the default format's names, importable from here as before the format door
__all__ = ["FORMAT_VERSION", "POINTER", "IncompleteCheckpointError", "iteration_of_dir",
           "latest_iteration", "list_iterations", "publish", "read_metadata", "shard_name",
           "staging_dir", "write_file_atomic"]


def staging_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Where a save of ``iteration`` is written before it is published."""
    return Path(str(iteration_dir(root, iteration)) + ".tmp")


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename.

    Raises:
        OSError: naming the temporary file (``file.write``'s errors, a full disk among them,
            name none); the temporary file is removed and ``path`` is untouched.
    """
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(tmp)) from e
        raise
    os.replace(tmp, path)


def publish(root: str | os.PathLike, iteration: int, metadata: dict, world_size: int,
            keep: int | Retention | None, fmt: CheckpointFormat | None = None) -> Path:
    """Rank 0, after every rank has written its files: verify, write metadata (stamped with
    the format and the next ``save_sequence``), rename, point, then prune.

    Args:
        keep: ``--save-keep-last``: a :class:`hybrid.checkpoint.retention.Retention` (the
            job's policy), a count (keep that many, newest in save order), or None (keep all).
            The checkpoint just published is never deleted.
        fmt: the format the ranks wrote (default: the default ``--ckpt-format``).

    Raises:
        IncompleteCheckpointError: a file of the format is missing from the staging directory.
    """
    fmt = fmt or format_named(DEFAULT_FORMAT)
    stage = staging_dir(root, iteration)
    files = fmt.files(world_size)
    missing = [s for s in files if not (stage / s).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"cannot publish iteration {iteration}: missing {missing} "
                                        f"in {stage}")
    meta = dict(metadata, **fmt.stamp(), iteration=iteration, shards=files)
    meta[SEQUENCE_KEY] = next_sequence(root)
    write_file_atomic(stage / "metadata.json", json.dumps(meta, indent=2, default=str).encode())
    final = iteration_dir(root, iteration)
    if final.exists():  # re-saving the same iteration (e.g. after a restart): replace it
        shutil.rmtree(final)
    os.replace(stage, final)
    write_file_atomic(Path(root) / POINTER, f"{iteration}\n".encode())
    if keep:
        (keep if isinstance(keep, Retention) else Retention(keep)).prune(root)
    return final
