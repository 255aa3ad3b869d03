"""Checkpoint directories: atomic publication, the "latest" pointer, retention, completeness.

Layout under ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     the newest *complete* iteration (Megatron's name)
    DIR/iter_0000500/metadata.json            grid, ZeRO stage, config, iteration, files, version
    DIR/iter_0000500/rank_00003.safetensors   one shard per rank
    DIR/iter_0000600.tmp/...                  a save in progress (never loaded)

Protocol: every rank writes its shard into ``iter_N.tmp`` under a temporary
file name and renames it; after a barrier, rank 0 checks every shard is there, writes
``metadata.json`` (listing the shards), renames the directory to ``iter_N``, then replaces the
pointer file atomically and only then deletes checkpoints beyond the newest ``keep`` in save
order (:mod:`hybrid.checkpoint.retention`: never the one just published). A
process killed anywhere in this sequence leaves the previous complete checkpoint in place and
pointed to.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hybrid.checkpoint import format1
from hybrid.checkpoint.names import ITER_PATTERN as _ITER
from hybrid.checkpoint.names import iteration_dir, list_iterations
from hybrid.checkpoint.retention import SEQUENCE_KEY, Retention, next_sequence

FORMAT_VERSION = 2
"""2: each rank stores its ZeRO partition's fragments (1: :mod:`hybrid.checkpoint.format1`)."""
READABLE_VERSIONS = (format1.VERSION, FORMAT_VERSION)
POINTER = "latest_checkpointed_iteration.txt"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory lacks its metadata or one of its shards."""


def iteration_of_dir(path: str | os.PathLike) -> int | None:
    """The iteration N when ``path`` is one published ``iter_N`` directory (it has its
    ``metadata.json``) rather than a checkpoint root; None otherwise."""
    m = _ITER.match(Path(path).name)
    return int(m.group(1)) if m and (Path(path) / "metadata.json").is_file() else None


def staging_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Where a save of ``iteration`` is written before it is published."""
    return Path(str(iteration_dir(root, iteration)) + ".tmp")


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


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
            keep: int | Retention | None) -> Path:
    """Rank 0, after every rank has written its shard: verify, write metadata (stamped with
    the next ``save_sequence``), rename, point, then prune.

    Args:
        keep: ``--save-keep-last``: a :class:`hybrid.checkpoint.retention.Retention` (the
            job's policy), a count (keep that many, newest in save order), or None (keep all).
            The checkpoint just published is never deleted.

    Raises:
        IncompleteCheckpointError: a shard is missing from the staging directory.
    """
    stage = staging_dir(root, iteration)
    shards = [shard_name(r) for r in range(world_size)]
    missing = [s for s in shards if not (stage / s).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"cannot publish iteration {iteration}: missing {missing} "
                                        f"in {stage}")
    meta = dict(metadata, format_version=FORMAT_VERSION, iteration=iteration, shards=shards)
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


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration the pointer names, or None when ``root`` has no published checkpoint."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise IncompleteCheckpointError(f"{pointer} does not hold an iteration number: {text!r}")
    return int(text)


def read_metadata(root: str | os.PathLike, iteration: int) -> dict:
    """``metadata.json`` of a published checkpoint, after checking every shard it lists exists.

    Raises:
        IncompleteCheckpointError: no metadata (the save never finished) or a missing shard;
            the message says which and where.
        FileNotFoundError: no such iteration directory.
    """
    d = iteration_dir(root, iteration)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint for iteration {iteration} in {root} "
                                f"(available: {list_iterations(root)})")
    meta_path = d / "metadata.json"
    if not meta_path.is_file():
        raise IncompleteCheckpointError(f"{d} has no metadata.json: the save did not finish; not "
                                        "loading it")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise IncompleteCheckpointError(f"{meta_path}: format version "
                                        f"{meta.get('format_version')}, this code reads versions "
                                        f"{READABLE_VERSIONS}")
    missing = [s for s in meta["shards"] if not (d / s).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"{d} is missing shards {missing}; not loading it")
    return meta
