"""Save and load training checkpoints in any format (:mod:`hybrid.checkpoint.format`), on any grid.

A save is collective and the same for every format: rank 0 creates the staging directory
(:mod:`hybrid.checkpoint.directory`: directories, atomicity, the "latest" pointer); every rank
hands its owned fragments and RNG states to the format (:meth:`CheckpointFormat.part`) and
writes its shard, one rank's part in that format (:func:`write_shard`); the ranks agree on the
outcome (:mod:`hybrid.checkpoint.agree`); rank 0 publishes ``metadata.json``
(:func:`checkpoint_metadata`: grid, ZeRO stage, loop counters, loss scaler, optimizer step,
every parameter's full shape, split dimension and padded size; the format stamps its name).
``--async-save`` runs the same steps with the write in a thread
(:mod:`hybrid.checkpoint.async_save`).

A load opens the checkpoint by the format its ``metadata.json`` names
(:func:`hybrid.checkpoint.registry.open_checkpoint`) and fills each fragment this rank's
optimizer updates from the reader, whatever (tp, dp, stage) saved it. RNG states are restored
only on the same grid. The default format's code: :mod:`hybrid.checkpoint.safetensors_format`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid.checkpoint.agree import all_succeed
from hybrid.checkpoint.directory import publish, staging_dir
from hybrid.checkpoint.registry import DEFAULT_FORMAT, format_named, open_checkpoint
from hybrid.checkpoint.retention import Retention
from hybrid.checkpoint.safetensors_format import CheckpointReader, shard_entries
from hybrid.parallel.rng import capture_rng_states, restore_rng_states
from hybrid.parallel.tp_spec import get_tp_spec
from hybrid.zero import state
from hybrid.zero.state import KINDS

if TYPE_CHECKING:
    from hybrid.checkpoint.format import CheckpointFormat, RankPart
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.zero.engine import ZeroEngine

# CheckpointReader and shard_entries: the default format's, importable from here as before the door
__all__ = ["KINDS", "CheckpointReader", "load_checkpoint", "save_checkpoint", "shard_entries",
           "write_shard"]


def save_checkpoint(root: str | os.PathLike, iteration: int, engine: ZeroEngine, grid: ProcessGrid,
                    train_state: dict, metadata: dict, tracker: RNGTracker | None = None,
                    keep: int | Retention | None = None,
                    fmt: CheckpointFormat | None = None) -> Path | None:
    """Write a checkpoint of ``iteration`` under ``root`` (collective: every rank calls).

    Args:
        root: ``--save`` directory.
        iteration: the completed iteration.
        engine: the :class:`hybrid.zero.engine.ZeroEngine`.
        grid: the process grid.
        train_state: JSON-able counters (iteration, consumed samples, schedule index, ...).
        metadata: JSON-able extras (config, tokenizer, model dims) for ``metadata.json``.
        tracker: the TP RNG tracker (its stream is saved with the other RNG states).
        keep: ``--save-keep-last``'s policy or count (None keeps all; see
            :mod:`hybrid.checkpoint.retention`).
        fmt: the format to write (``--ckpt-format``; default
            :data:`hybrid.checkpoint.registry.DEFAULT_FORMAT`).

    Returns:
        The published directory on rank 0, None elsewhere.

    Raises:
        hybrid.checkpoint.agree.SaveFailedError: on every rank, when creating the staging
            directory, writing any rank's shard or publishing failed (a full disk: errno 28,
            ENOSPC); it names the ranks, the path and the errno, and the staging directory has
            been removed. The previous checkpoint and the pointer are untouched.
    """
    fmt = fmt or format_named(DEFAULT_FORMAT)
    stage_dir = begin_save(root, iteration, grid)
    part = rank_part(fmt, engine, grid, tracker)
    all_succeed(lambda: write_shard(stage_dir, grid.rank, part, fmt), grid.device,
                f"saving iteration {iteration} to {root}", cleanup=stage_dir)
    meta = checkpoint_metadata(engine, grid, train_state, metadata) if grid.rank == 0 else None
    return publish_agreed(root, iteration, meta, grid, keep, fmt)


def begin_save(root: str | os.PathLike, iteration: int, grid: ProcessGrid) -> Path:
    """Create the staging directory (rank 0; collective, agreed); returns it."""
    stage_dir = staging_dir(root, iteration)

    def make():
        if grid.rank == 0:
            if stage_dir.exists():  # a killed save's leftovers (the directory lock excludes a
                shutil.rmtree(stage_dir)  # live writer): no stale shard may be published
            stage_dir.mkdir(parents=True)

    all_succeed(make, grid.device, f"saving iteration {iteration} to {root}")
    return stage_dir


def rank_part(fmt: CheckpointFormat, engine: ZeroEngine, grid: ProcessGrid,
              tracker: RNGTracker | None) -> RankPart:
    """This rank's part in ``fmt``: its owned fragments and its RNG states (every rank calls
    it at the same point)."""
    return fmt.part(engine, grid, capture_rng_states(tracker, grid.device))


def write_shard(stage_dir: Path, rank: int, part: RankPart, fmt: CheckpointFormat) -> None:
    """Write global rank ``rank``'s part into ``stage_dir`` in ``fmt``: the one place a rank's
    checkpoint bytes are written, by a synchronous save and by ``--async-save``'s thread alike
    (no collective)."""
    fmt.write(stage_dir, rank, part)


def publish_agreed(root: str | os.PathLike, iteration: int, meta: dict | None,
                   grid: ProcessGrid, keep: int | Retention | None,
                   fmt: CheckpointFormat | None = None) -> Path | None:
    """Rank 0 publishes (``meta``: its :func:`checkpoint_metadata`; None elsewhere) what the
    ranks wrote in ``fmt`` (default: the default format), every rank agrees on the outcome
    (collective). Returns the published directory on rank 0.

    Raises:
        hybrid.checkpoint.agree.SaveFailedError: publication failed (every rank).
    """
    final: list[Path] = []

    def step():
        if grid.rank == 0:
            final.append(publish(root, iteration, meta, grid.world_size, keep, fmt))

    all_succeed(step, grid.device, f"saving iteration {iteration} to {root}",
                cleanup=staging_dir(root, iteration))
    return final[0] if final else None


def checkpoint_metadata(engine: ZeroEngine, grid: ProcessGrid, train_state: dict,
                        metadata: dict) -> dict:
    """``metadata.json``'s content besides what :func:`publish` adds (the format's stamp, the
    iteration, the files, the save sequence), the same in every format: ``metadata`` plus the
    grid, ZeRO stage, loop counters, loss scaler, optimizer step and every parameter's full
    shape, split dimension and padded size."""
    specs = {s.name: get_tp_spec(engine.params[s.index]) for s in engine.layout.slots}
    params = {name: dict(full_shape=list(s.full_shape), split_dim=s.split_dim,
                         padded_size=s.padded_size)
              for name, s in specs.items()}
    return dict(metadata, grid=dict(tp=grid.tp_size, dp=grid.dp_size, world_size=grid.world_size),
                zero_stage=engine.stage, train_state=train_state,
                loss_scaler=engine.scaler.state_dict(),
                optimizer_step=state.optimizer_step(engine), params=params)


def load_checkpoint(root: str | os.PathLike, engine: ZeroEngine, grid: ProcessGrid,
                    tracker: RNGTracker | None = None, load_optim: bool = True,
                    load_rng: bool = True) -> dict:
    """Load the latest complete checkpoint under ``root`` into ``engine`` (collective), in the
    format its ``metadata.json`` names.

    Each rank reads only the saved elements that overlap the fragments its optimizer updates
    (its partition; stage 0: everything). With ``load_optim=False`` only the weights come back
    (fresh Adam moments, step 0). RNG states come back only when ``load_rng`` and the grid
    equals the saved one.

    Returns:
        ``metadata.json`` of the loaded checkpoint (its ``train_state`` restores the loop), plus
        ``"read"``: this rank's ``{"bytes": tensor bytes read, "reads": reads issued}``.

    Raises:
        FileNotFoundError, hybrid.checkpoint.published.IncompleteCheckpointError: as
            :func:`hybrid.checkpoint.registry.open_checkpoint`.
        KeyError: the checkpoint's parameter names differ from the model's.
        ValueError: a parameter's full shape or split dimension differs.
    """
    reader = open_checkpoint(root)
    saved, ours = set(reader.meta["params"]), {s.name for s in engine.layout.slots}
    if saved != ours:
        raise KeyError(f"checkpoint {reader.root} does not match the model: missing "
                       f"{sorted(ours - saved)}, unexpected {sorted(saved - ours)}")

    def fill(slot, spec, start, stop, kind, out):
        reader.read_local(slot.name, kind, spec, start, stop, out)

    state.import_state(engine, fill, int(reader.meta["optimizer_step"]) if load_optim else 0,
                       load_optim)
    if load_optim:
        engine.scaler.load_state_dict(reader.meta["loss_scaler"])
    tp, dp = reader.meta["grid"]["tp"], reader.meta["grid"]["dp"]
    if load_rng and (tp, dp) == (grid.tp_size, grid.dp_size):
        restore_rng_states(reader.rng_states(grid.rank), tracker, grid.device)
    elif load_rng and grid.rank == 0:
        warnings.warn(f"checkpoint grid tp={tp} x dp={dp} differs from this run's "
                      f"tp={grid.tp_size} x dp={grid.dp_size}: RNG states are not restored",
                      stacklevel=2)
    return dict(reader.meta, read=dict(bytes=reader.bytes_read, reads=reader.reads))
