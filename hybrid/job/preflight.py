"""Pre-flight checks of every path the job writes, before any process group starts.

A ``--save`` under a regular file, on a read-only file system or in ``/proc``, a metrics file, a
TensorBoard or wandb directory that cannot be written, or a data index cache beside read-only
data would otherwise fail at its first write: after the process groups start (a traceback from
every rank) or, for ``--save``, a whole save interval into training. Each path is probed for
real (a file created and removed), because permissions alone do not show a read-only mount, and
root passes every permission check.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError

CACHE_SUBDIR = Path("cache") / "GPTDataset_indices"  # the index cache beside the data


def unwritable(path: str | os.PathLike, is_dir: bool = True) -> str | None:
    """Why ``path`` cannot be written (a directory, or with ``is_dir=False`` a file), or None.

    A path that does not exist yet counts as writable when its nearest existing ancestor is a
    directory where one can create it. The probe creates and removes a uniquely named entry.
    """
    p = Path(path).absolute()
    if p.exists():
        if p.is_dir() != is_dir:
            return "it is a directory" if p.is_dir() else "it is a file, not a directory"
        return _probe(p) if is_dir else _open_for_append(p)
    ancestor = p.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    why = _probe(ancestor)
    return why and f"{why} (creating it in {ancestor})"


def _probe(directory: Path) -> str | None:
    try:
        fd, name = tempfile.mkstemp(prefix=".hybrid-preflight-", dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(name)
    return None


def _open_for_append(file: Path) -> str | None:
    try:
        with open(file, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def index_cache_dirs(cfg: PretrainConfig) -> list[tuple[Path, bool]]:
    """``(directory, given)`` of every data index cache the job may write: ``--data-cache-path``
    (given), else the ``cache/GPTDataset_indices`` beside each ``--data-path`` dataset."""
    d = cfg.data
    if d.mock_data or not d.data_path:
        return []
    if d.data_cache_path:
        return [(Path(d.data_cache_path), True)]
    from data.blended_dataset import parse_data_path

    _, prefixes = parse_data_path(d.data_path)
    return list(dict.fromkeys((Path(os.path.abspath(p)).parent / CACHE_SUBDIR, False)
                              for p in prefixes))


def _missing_index(job, read_only: list[Path]) -> Path | None:
    """The first index file ``job`` needs that is missing from a ``read_only`` cache directory,
    found by running the dataset builder (:func:`hybrid.job.datasets.build_datasets`, its own
    sizes and cache names) without writing (:func:`data.index_cache.probing`); None when they
    hold every one, or when the data itself is at fault (the ranks report that, as before)."""
    import contextlib
    import io

    from data.index_cache import MissingIndexError, probing
    from hybrid.job.datasets import build_datasets

    state = _resumed_state(job)
    try:  # its notes (a skipped split) are printed by the job itself
        with probing(read_only), contextlib.redirect_stdout(io.StringIO()):
            build_datasets(job, state)
    except MissingIndexError as e:
        return e.path
    except (ValueError, OSError):
        return None
    return None


def _resumed_state(job):
    """The loop counters the ranks will restore from ``--load``'s latest checkpoint (a resumed
    job's splits are sized from its consumed samples, so its indices differ from a fresh
    run's); None for a fresh run, ``--finetune``, or a checkpoint that cannot be read (the
    ranks report that)."""
    from hybrid.job.resume_checks import checkpoint_metadata
    from hybrid.training import TrainState

    c = job.cfg.checkpoint
    if not c.load or c.finetune:
        return None
    try:
        meta = checkpoint_metadata(c.load)
        state = TrainState()
        if meta is not None:
            state.restore(meta["train_state"], job.global_batch_size)
    except (ValueError, OSError, RuntimeError, KeyError, TypeError):
        return None
    return state if meta is not None else None


def check_index_caches(job) -> None:
    """A data index cache that cannot be written (``--data-cache-path``, or the default beside
    the data) is accepted only when it holds every index file this job needs (built beforehand,
    say by whoever made the shared data); it is then read as it is.

    Raises:
        ConfigError: the directory, why it cannot be written, the missing index, and
            ``--data-cache-path``.
    """
    dirs = {os.path.abspath(d): (d, given, why) for d, given in index_cache_dirs(job.cfg)
            if (why := unwritable(d))}
    missing = _missing_index(job, list(dirs)) if dirs else None
    if missing is None:
        return
    directory, given, why = dirs[os.path.abspath(missing.parent)]
    lacks = f"cannot be written: {why}; it lacks the index {missing.name} this job needs"
    if given:
        raise ConfigError(f"--data-cache-path {directory} {lacks}; give --data-cache-path a "
                          "writable directory (or one that holds this job's indices)")
    raise ConfigError(f"the data index cache {directory} (default: beside --data-path) {lacks}; "
                      "give --data-cache-path DIR, a writable directory (read-only data is fine)")


def check_paths(cfg: PretrainConfig) -> None:
    """Refuse the first output path that cannot be written, naming it and the flag that moves it.

    Checks ``--save``, ``--metrics-file``, ``--tensorboard-dir``, with ``--wandb-project``
    ``--wandb-save-dir`` (default ``$WANDB_DIR`` or ``./wandb``), and with ``--profile`` the
    trace directory (:func:`hybrid.torch_profile.trace_dir`: ``./torch_profile``, or beside
    ``--tensorboard-dir``; written after the profiled iterations, so a read-only working
    directory would fail the job only then); the data index caches need the validated job
    (:func:`check_index_caches`).

    Raises:
        ConfigError: ``<flag> <path> cannot be written: <reason>; ...``.
    """
    lg = cfg.logging
    wandb_dir = lg.wandb_project and (lg.wandb_save_dir or os.environ.get("WANDB_DIR") or "wandb")
    outputs = [("--save", cfg.checkpoint.save, True), ("--metrics-file", lg.metrics_file, False),
               ("--tensorboard-dir", lg.tensorboard_dir, True),
               ("--wandb-save-dir", wandb_dir, True)]
    for flag, path, is_dir in outputs:
        if path and (why := unwritable(path, is_dir)):
            raise ConfigError(f"{flag} {path} cannot be written: {why}; give {flag} a writable "
                              f"{'directory' if is_dir else 'file'}")
    _check_trace_dir(cfg)


def _check_trace_dir(cfg: PretrainConfig) -> None:
    """``--profile``'s trace directory can be written (when the window holds an iteration)."""
    from hybrid.torch_profile import trace_dir

    lg = cfg.logging
    if not lg.profile or lg.profile_step_start > (cfg.training.train_iters or 0):
        return
    path = trace_dir(lg.tensorboard_dir)
    if why := unwritable(path):
        where = ("beside --tensorboard-dir" if lg.tensorboard_dir
                 else "in the working directory, without --tensorboard-dir")
        raise ConfigError(f"--profile writes its traces to {path.absolute()} ({where}), which "
                          f"cannot be written: {why}; give --tensorboard-dir DIR with a writable "
                          "parent (the traces go to DIR/../torch_profile), or run from a "
                          "writable directory")
