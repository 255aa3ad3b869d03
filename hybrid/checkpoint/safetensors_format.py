"""``--ckpt-format safetensors``: this trainer's own format, one safetensors file per rank.

Each rank writes one safetensors shard holding only what it owns: for every parameter, the fp32
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
weights, rounded. RNG states are stored per rank (``rng/{name}``). ``metadata.json`` says
``ckpt_format: safetensors`` and ``format_version: 2``; checkpoints from before the format door
have the version only, and are this format too.
Format 1 checkpoints (equal ``dp`` cuts of every parameter, written before partition-wise
saving) are read by the same code; :mod:`hybrid.checkpoint.format1` holds what differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybrid.checkpoint import format1
from hybrid.checkpoint.format import FORMAT_KEY, CheckpointFormat, RankPart
from hybrid.checkpoint.fragments import FragmentReader, RankRows
from hybrid.checkpoint.names import iteration_dir
from hybrid.checkpoint.published import IncompleteCheckpointError, chosen_iteration, read_metadata
from hybrid.checkpoint.stream import Entry, write_safetensors
from hybrid.zero import state
from hybrid.zero.state import KINDS, OwnedFragment

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.zero.engine import ZeroEngine

NAME = "safetensors"
FORMAT_VERSION = 2
"""2: each rank stores its ZeRO partition's fragments (1: :mod:`hybrid.checkpoint.format1`)."""
READABLE_VERSIONS = (format1.VERSION, FORMAT_VERSION)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


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



class SafetensorsFormat(CheckpointFormat):
    """``--ckpt-format safetensors`` (the default): one streamed safetensors shard per rank."""

    name = NAME
    description = ("this trainer's format: one safetensors file per rank holding its ZeRO "
                   "partition, read on any grid")

    def part(self, engine: ZeroEngine, grid: ProcessGrid,
             rng: dict[str, torch.Tensor]) -> RankPart:
        """This rank's fragments (:func:`shard_entries`) and RNG states (``rng/{name}``); the
        header is the fragments' layout."""
        entries, layout = shard_entries(state.owned_state(engine), grid.tp_rank)
        entries += [Entry(f"rng/{key}", value.dtype, tuple(value.shape), lambda v=value: v)
                    for key, value in rng.items()]
        return RankPart(entries, {"layout": json.dumps(layout)})

    def write(self, stage_dir: Path, rank: int, part: RankPart) -> None:
        """Stream the shard into ``stage_dir`` under a temporary name, then rename it."""
        tmp = stage_dir / (shard_name(rank) + ".partial")
        write_safetensors(tmp, part.entries, metadata={**part.header, "rank": str(rank)})
        os.replace(tmp, stage_dir / shard_name(rank))

    def files(self, world_size: int) -> list[str]:
        return [shard_name(r) for r in range(world_size)]

    def reader(self, root: Path, iteration: int, meta: dict) -> CheckpointReader:
        return CheckpointReader(root, iteration, meta)

    def stamp(self) -> dict:
        return {FORMAT_KEY: NAME, "format_version": FORMAT_VERSION}

    def claims(self, meta: dict) -> bool:
        """Named so, or written before ``metadata.json`` named formats (a version, no name)."""
        return meta.get(FORMAT_KEY, NAME if "format_version" in meta else None) == NAME

    def check(self, meta: dict, where: Path) -> None:
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise IncompleteCheckpointError(f"{where}: format version "
                                            f"{meta.get('format_version')}, this code reads "
                                            f"versions {READABLE_VERSIONS}")


SAFETENSORS = SafetensorsFormat()


class CheckpointReader(FragmentReader):
    """A published checkpoint of this format, whatever its grid: reads parts or whole tensors by
    overlap (a :class:`hybrid.checkpoint.format.Reader`).

    Args:
        root: the checkpoint root (``--load``).
        iteration: which iteration (default: the latest complete one).
        meta: its ``metadata.json`` when already read and checked (default: read it here).

    Raises:
        FileNotFoundError: no published checkpoint under ``root``.
        hybrid.checkpoint.published.IncompleteCheckpointError: metadata or a shard is missing,
            the checkpoint is of another format or version, or the shards' fragments do not
            cover every parameter.
    """

    def __init__(self, root: str | os.PathLike, iteration: int | None = None,
                 meta: dict | None = None):
        iteration = chosen_iteration(root, iteration)
        if meta is None:
            meta = read_metadata(root, iteration)
            where = iteration_dir(root, iteration) / "metadata.json"
            if not SAFETENSORS.claims(meta):
                raise IncompleteCheckpointError(f"{where}: not a {NAME} checkpoint (its "
                                                f"{FORMAT_KEY}: {meta.get(FORMAT_KEY)})")
            SAFETENSORS.check(meta, where)
        self.root, self.iteration = Path(root), iteration
        super().__init__(iteration_dir(root, iteration), meta)
        self.dp = self.meta["grid"]["dp"]

    def param_names(self) -> list[str]:
        return list(self.meta["params"])

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        f = self.files[rank]
        return {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
