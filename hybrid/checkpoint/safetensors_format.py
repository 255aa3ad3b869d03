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
weights, rounded. RNG states are stored per rank (``rng/{name}``).
Format 1 checkpoints (equal ``dp`` cuts of every parameter, written before partition-wise
saving) are read by the same code; :mod:`hybrid.checkpoint.format1` holds what differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from hybrid.checkpoint.directory import (
    iteration_of_dir,
    latest_iteration,
    read_metadata,
    shard_name,
)
from hybrid.checkpoint.fragments import FragmentReader, RankRows
from hybrid.checkpoint.stream import Entry, write_safetensors
from hybrid.zero.state import KINDS, OwnedFragment

__all__ = ["CheckpointReader", "shard_entries", "write_shard"]


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



def write_shard(stage_dir: Path, rank: int, entries: list[Entry], layout: dict) -> None:
    """Stream this rank's shard into ``stage_dir`` under a temporary name, then rename it."""
    tmp = stage_dir / (shard_name(rank) + ".partial")
    write_safetensors(tmp, entries, metadata={"layout": json.dumps(layout), "rank": str(rank)})
    os.replace(tmp, stage_dir / shard_name(rank))



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
