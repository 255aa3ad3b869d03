"""Save and load training checkpoints that any grid can read (exact resume and resharding).

Each rank writes one safetensors shard (``hybrid.checkpoint.directory`` handles directories,
atomicity and the "latest" pointer) holding only what it owns: for every parameter, the fp32
``master``, ``exp_avg`` and ``exp_avg_sq`` of its ZeRO partition's fragment
(:func:`hybrid.zero.state.owned_state`), without vocabulary padding, keyed ``{kind}/{name}``.
Stage 0 ranks split the writing the same way; replicated parameters are written by TP rank 0
only. No model state is all-gathered, and the shard is streamed tensor by tensor
(:mod:`hybrid.checkpoint.stream`), so saving stages one fragment at most. The shard's
safetensors metadata places each fragment (source TP rank, range of the unpadded TP-local
tensor, flattened); ``metadata.json`` records each parameter's full shape, split dimension and
padded size with the grid (see :mod:`hybrid.checkpoint.fragments` for the geometry).

Loading fills each fragment this rank's optimizer updates by reading, from the shards that hold
them, exactly the elements that overlap it, whatever (tp, dp, stage) saved the checkpoint; the
reader counts the bytes. The 16/32-bit model weights are not stored: they are the master
weights, rounded. RNG states are stored per rank and restored only on the same grid.
Format 1 checkpoints (equal ``dp`` cuts of every parameter, written before partition-wise
saving) are read by the same code; :mod:`hybrid.checkpoint.format1` holds what differs.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybrid.checkpoint.agree import all_succeed
from hybrid.checkpoint.directory import (
    iteration_of_dir,
    latest_iteration,
    publish,
    read_metadata,
    shard_name,
    staging_dir,
)
from hybrid.checkpoint.fragments import FragmentReader, RankRows
from hybrid.checkpoint.retention import Retention
from hybrid.checkpoint.stream import Entry, write_safetensors
from hybrid.parallel.rng import capture_rng_states, restore_rng_states
from hybrid.parallel.tp_spec import get_tp_spec
from hybrid.zero import state
from hybrid.zero.state import KINDS, OwnedFragment

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.zero.engine import ZeroEngine

__all__ = ["KINDS", "CheckpointReader", "load_checkpoint", "save_checkpoint"]


def shard_entries(fragments: Iterable[OwnedFragment], tp_rank: int) -> tuple[list[Entry], dict]:
    """The stream entries (``{kind}/{name}``: the fragment's real elements, fp32, 1-D) and the
    layout metadata (``{name: {"tp_rank", "flat_range"}}``, the range in real-local coordinates)
    of one rank's shard. Replicated parameters are left to TP rank 0; padding-only fragments
    are skipped."""
    entries, layout = [], {}
    for f in fragments:
        if f.spec.replicated and tp_rank != 0:
            continue
        rows = RankRows.of_spec(f.spec)
        lo, hi = rows.real_index(f.start), rows.real_index(f.stop)
        if hi == lo:
            continue
        layout[f.slot.name] = dict(tp_rank=tp_rank, flat_range=[lo, hi])
        for kind in KINDS:
            entries.append(Entry(f"{kind}/{f.slot.name}", torch.float32, (hi - lo,),
                                 lambda v=f.views[kind], s=f.start, r=rows: r.real_part(v, s)))
    return entries, layout


def save_checkpoint(root: str | os.PathLike, iteration: int, engine: ZeroEngine, grid: ProcessGrid,
                    train_state: dict,
                    metadata: dict, tracker: RNGTracker | None = None,
                    keep: int | Retention | None = None) -> Path | None:
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

    Returns:
        The published directory on rank 0, None elsewhere.

    Raises:
        hybrid.checkpoint.agree.SaveFailedError: on every rank, when creating the staging
            directory, writing any rank's shard or publishing failed (a full disk: errno 28,
            ENOSPC); it names the ranks, the path and the errno, and the staging directory has
            been removed. The previous checkpoint and the pointer are untouched.
    """
    stage_dir = begin_save(root, iteration, grid)
    entries, layout = rank_entries(engine, grid, tracker)
    all_succeed(lambda: write_shard(stage_dir, grid.rank, entries, layout), grid.device,
                f"saving iteration {iteration} to {root}", cleanup=stage_dir)
    meta = checkpoint_metadata(engine, grid, train_state, metadata) if grid.rank == 0 else None
    return publish_agreed(root, iteration, meta, grid, keep)


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


def rank_entries(engine: ZeroEngine, grid: ProcessGrid,
                 tracker: RNGTracker | None) -> tuple[list[Entry], dict]:
    """This rank's shard: its fragments' entries and layout (:func:`shard_entries`) plus its
    RNG states (``rng/{name}``)."""
    entries, layout = shard_entries(state.owned_state(engine), grid.tp_rank)
    for key, value in capture_rng_states(tracker, grid.device).items():
        entries.append(Entry(f"rng/{key}", value.dtype, tuple(value.shape), lambda v=value: v))
    return entries, layout


def publish_agreed(root: str | os.PathLike, iteration: int, meta: dict | None,
                   grid: ProcessGrid, keep: int | Retention | None) -> Path | None:
    """Rank 0 publishes (``meta``: its :func:`checkpoint_metadata`; None elsewhere), every rank
    agrees on the outcome (collective). Returns the published directory on rank 0.

    Raises:
        hybrid.checkpoint.agree.SaveFailedError: publication failed (every rank).
    """
    final: list[Path] = []

    def step():
        if grid.rank == 0:
            final.append(publish(root, iteration, meta, grid.world_size, keep))

    all_succeed(step, grid.device, f"saving iteration {iteration} to {root}",
                cleanup=staging_dir(root, iteration))
    return final[0] if final else None


def write_shard(stage_dir: Path, rank: int, entries: list[Entry], layout: dict) -> None:
    """Stream this rank's shard into ``stage_dir`` under a temporary name, then rename it."""
    tmp = stage_dir / (shard_name(rank) + ".partial")
    write_safetensors(tmp, entries, metadata={"layout": json.dumps(layout), "rank": str(rank)})
    os.replace(tmp, stage_dir / shard_name(rank))


def checkpoint_metadata(engine: ZeroEngine, grid: ProcessGrid, train_state: dict,
                        metadata: dict) -> dict:
    """``metadata.json``'s content besides what :func:`publish` adds: ``metadata`` plus the
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


class CheckpointReader(FragmentReader):
    """A published checkpoint, whatever its grid: reads parts or whole tensors by overlap.

    Args:
        root: the checkpoint root (``--load``).
        iteration: which iteration (default: the latest complete one).

    Raises:
        FileNotFoundError: no published checkpoint under ``root``.
        hybrid.checkpoint.directory.IncompleteCheckpointError: metadata or a shard is missing,
            or the shards' fragments do not cover every parameter.
    """

    def __init__(self, root: str | os.PathLike, iteration: int | None = None):
        if iteration is None:
            iteration = latest_iteration(root)
            if iteration is None:
                hint = ""
                if (n := iteration_of_dir(root)) is not None:
                    hint = (f"; {root} is one iteration's directory: give the checkpoint root "
                            f"{Path(root).parent} and --iteration {n}")
                raise FileNotFoundError(f"no complete checkpoint under {root} (no "
                                        f"{root}/latest_checkpointed_iteration.txt){hint}")
        self.root, self.iteration = Path(root), iteration
        super().__init__(self.root / f"iter_{iteration:07d}", read_metadata(root, iteration))
        self.dp = self.meta["grid"]["dp"]

    def param_names(self) -> list[str]:
        return list(self.meta["params"])

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        f = self.files[rank]
        return {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}


def load_checkpoint(root: str | os.PathLike, engine: ZeroEngine, grid: ProcessGrid,
                    tracker: RNGTracker | None = None, load_optim: bool = True,
                    load_rng: bool = True) -> dict:
    """Load the latest complete checkpoint under ``root`` into ``engine`` (collective).

    Each rank reads only the saved elements that overlap the fragments its optimizer updates
    (its partition; stage 0: everything). With ``load_optim=False`` only the weights come back
    (fresh Adam moments, step 0). RNG states come back only when ``load_rng`` and the grid
    equals the saved one.

    Returns:
        ``metadata.json`` of the loaded checkpoint (its ``train_state`` restores the loop), plus
        ``"read"``: this rank's ``{"bytes": tensor bytes read, "reads": get_slice calls}``.

    Raises:
        KeyError: the checkpoint's parameter names differ from the model's.
        ValueError: a parameter's full shape or split dimension differs.
    """
    reader = CheckpointReader(root)
    saved, ours = set(reader.param_names()), {s.name for s in engine.layout.slots}
    if saved != ours:
        raise KeyError(f"checkpoint {reader.root} does not match the model: missing "
                       f"{sorted(ours - saved)}, unexpected {sorted(saved - ours)}")

    def fill(slot, spec, start, stop, kind, out):
        reader.read_local(slot.name, kind, spec, start, stop, out)

    state.import_state(engine, fill, int(reader.meta["optimizer_step"]) if load_optim else 0,
                       load_optim)
    if load_optim:
        engine.scaler.load_state_dict(reader.meta["loss_scaler"])
    same_grid = (reader.tp, reader.dp) == (grid.tp_size, grid.dp_size)
    if load_rng and same_grid:
        restore_rng_states(reader.rng_states(grid.rank), tracker, grid.device)
    elif load_rng and grid.rank == 0:
        warnings.warn(f"checkpoint grid tp={reader.tp} x dp={reader.dp} differs from this run's "
                      f"tp={grid.tp_size} x dp={grid.dp_size}: RNG states are not restored",
                      stacklevel=2)
    return dict(reader.meta, read=dict(bytes=reader.bytes_read, reads=reader.reads))
