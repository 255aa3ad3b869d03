"""On-disk cache of index arrays (``.npy``) keyed by a hash of the settings that produce them.

A cache entry is ``<dir>/<md5>-<kind>-<array>.npy`` for each array, plus
``<md5>-<kind>-description.json`` holding the settings in clear, where ``md5`` hashes that
description. Any change of settings (data file, split, seq_length, seed, sample count, format
version) gives a new name, so a stale entry is never read. **Content-safe keys:** a
description holds the digest of the *content* its arrays are computed from
(:func:`array_digest`, :func:`file_digest`: SHA-256), never a file's size or modification time,
which ``cp -p``, ``rsync -t``, ``tar x`` or ``os.utime`` carry over to a rewritten file.
Files are written under unique temporary names and renamed into place, so concurrent builders
(several ranks or nodes) are safe and a reader never sees a half-written array. Entries are
loaded memory-mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

DIGEST_CHUNK = 8 * 2**20
"""Bytes hashed per read by :func:`file_digest`."""


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of the file's bytes (one sequential read: ~1.3 GB/s on a core with
    the SHA extensions, 8 MiB of memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DIGEST_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def array_digest(*arrays: np.ndarray) -> str:
    """SHA-256 hex digest of the arrays' dtypes, shapes and bytes, in order (memory-mapped
    arrays are read once, sequentially; a contiguous array is not copied)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def cache_key(description: dict) -> str:
    """md5 hex digest of the description as canonical JSON."""
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


class MissingIndexError(Exception):
    """A cache file that :func:`probing` found missing in a read-only cache directory.

    Attributes:
        path: the missing ``.npy`` file.
    """

    def __init__(self, path: Path):
        super().__init__(f"missing index {path}")
        self.path = path


_PROBES: list[set[str]] = []  # read-only directories of the active probing() contexts


@contextlib.contextmanager
def probing(read_only_dirs) -> Iterator[None]:
    """Within it, :func:`load_or_build` writes nothing: a cache miss in one of
    ``read_only_dirs`` raises :class:`MissingIndexError`, one elsewhere returns the arrays built
    in memory. The pre-flight check runs the dataset builder so to learn, with the builder's own
    names, whether read-only caches hold every index a job needs."""
    _PROBES.append({os.path.abspath(d) for d in read_only_dirs})
    try:
        yield
    finally:
        _PROBES.pop()


def _atomic_write(path: Path, write: Callable) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_build(
    cache_dir: str | os.PathLike,
    kind: str,
    description: dict,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The arrays ``names`` from the cache, after building and saving them if absent.

    Args:
        cache_dir: directory of the cache (created if needed).
        kind: readable part of the file names, e.g. ``"GPTDataset-train"``.
        description: JSON-serialisable settings that fully determine the arrays.
        names: the arrays ``build`` returns.
        build: computes ``{name: array}``; called only on a cache miss.

    Returns:
        ``{name: array}``, memory-mapped read-only from the cache files.

    A cache file that exists but cannot be read (truncated by a copy or a full disk) is named
    in a ``RuntimeWarning`` and rebuilt.

    Raises:
        OSError: the cache directory cannot be created or written (pass another one); an
            unreadable cache file that cannot be rebuilt there (named).
        MissingIndexError: a miss in a read-only directory of :func:`probing`.
    """
    base = Path(cache_dir)
    stem = f"{cache_key(description)}-{kind}"
    paths = {n: base / f"{stem}-{n}.npy" for n in names}
    if _PROBES and not all(p.is_file() for p in paths.values()):
        if os.path.abspath(base) in _PROBES[-1]:
            raise MissingIndexError(next(p for p in paths.values() if not p.is_file()))
        return build()
    if all(p.is_file() for p in paths.values()):
        loaded = _read(paths)
        if isinstance(loaded, dict):
            return loaded
        bad, why = loaded
        warnings.warn(f"index cache file {bad} is unreadable ({why}; a copy or a write cut "
                      "short?): rebuilding it", RuntimeWarning, stacklevel=2)
        try:
            _write(base, stem, paths, description, build())
        except OSError as e:
            raise OSError(f"index cache file {bad} is unreadable ({why}) and cannot be rebuilt "
                          f"there ({e}): delete it, or pass another --data-cache-path") from e
    else:
        base.mkdir(parents=True, exist_ok=True)
        _write(base, stem, paths, description, build())
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


def _read(paths: dict[str, Path]) -> dict[str, np.ndarray] | tuple[Path, str]:
    """``{name: array}`` memory-mapped from ``paths``; ``(file, why)`` for the first file that
    cannot be read as an array (truncated, not an ``.npy``)."""
    out = {}
    for n, p in paths.items():
        try:
            out[n] = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            return p, f"{type(e).__name__}: {e}"
    return out


def _write(base: Path, stem: str, paths: dict[str, Path], description: dict,
           arrays: dict[str, np.ndarray]) -> None:
    """Save ``arrays`` under ``paths`` and the description beside them, each atomically."""
    for n, p in paths.items():
        _atomic_write(
            p, lambda f, a=arrays[n]: np.save(f, np.ascontiguousarray(a), allow_pickle=False)
        )
    text = json.dumps(description, sort_keys=True, indent=1).encode()
    _atomic_write(base / f"{stem}-description.json", lambda f: f.write(text))
