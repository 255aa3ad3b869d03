"""Where a saved fragment lies in the full tensor, and reading only the bytes that overlap.

A checkpoint stores each parameter's fp32 states as *fragments*: contiguous ranges of one TP
rank's **unpadded local tensor, flattened** ("real-local" coordinates; vocabulary padding rows
are dropped). To place them, view the full tensor (shape ``full_shape``, split along ``s``) as a
matrix of ``outer = prod(full_shape[:s])`` rows by ``D * inner`` columns (``D = full_shape[s]``,
``inner = prod(full_shape[s+1:])``). TP rank ``t`` of ``T`` (``per = padded_size / T``) holds,
in every row, the columns ``[t * per * inner, (t * per + real_t) * inner)``, ``real_t`` its
unpadded part of ``per``. A replicated parameter is one row held whole by rank 0. So a range of
one rank's real-local tensor is, row by row, a column range of the full matrix, and any other
(tp, rank)'s range can be intersected with it in O(rows it spans) without touching data.

:class:`FragmentReader` indexes every shard's fragments from their safetensors headers, then
fills a target range (any TP size, any data-parallel cut) with ``safe_open(...).get_slice``
reads of exactly the overlapping elements, and counts the bytes it read.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.checkpoint import format1
from hybrid.checkpoint.published import IncompleteCheckpointError
from hybrid.parallel.tp_spec import TPSpec

READ_CHUNK = 4 * 2**20
"""Elements per ``get_slice`` read at most (16 MiB of fp32): what a read stages besides its
target."""


@dataclass(frozen=True)
class RankRows:
    """One TP rank's share of a parameter in the row/column view of the full tensor."""

    outer: int
    """Rows of the full matrix (and of every local tensor)."""
    col0: int
    """First full-matrix column this rank holds."""
    wl: int
    """Columns per row of the local tensor, padding included (its flat row stride)."""
    wr: int
    """Real (unpadded) columns per row: the real-local row stride."""

    @classmethod
    def of(cls, full_shape, split_dim: int | None, padded_size: int, tp_size: int,
           tp_rank: int) -> RankRows:
        """Raises ValueError: ``padded_size`` not a multiple of ``tp_size`` or below the full
        size."""
        shape = tuple(full_shape)
        numel = 1
        for d in shape:
            numel *= d
        if split_dim is None:
            return cls(1, 0, numel, numel)
        if padded_size % tp_size or padded_size < shape[split_dim]:
            raise ValueError(f"padded size {padded_size} must be a multiple of tp={tp_size} and at "
                             f"least the full size {shape[split_dim]} of dimension {split_dim}")
        outer = inner = 1
        for d in shape[:split_dim]:
            outer *= d
        for d in shape[split_dim + 1:]:
            inner *= d
        per = padded_size // tp_size
        real = max(0, min(per, shape[split_dim] - tp_rank * per))
        return cls(outer, tp_rank * per * inner, per * inner, real * inner)

    @classmethod
    def of_spec(cls, spec: TPSpec) -> RankRows:
        """This rank's rows (a replicated parameter: the whole tensor as one row)."""
        return cls.of(spec.full_shape, spec.split_dim, spec.padded_size, spec.tp_size, spec.tp_rank)

    @property
    def real_numel(self) -> int:
        return self.outer * self.wr

    def real_index(self, x: int) -> int:
        """Real elements before padded-local flat position ``x`` (maps ranges of the padded
        local tensor onto contiguous real-local ranges)."""
        if self.wl == 0:
            return 0
        return (x // self.wl) * self.wr + min(x % self.wl, self.wr)

    def real_part(self, buf: torch.Tensor, start: int) -> torch.Tensor:
        """The real elements of ``buf`` (padded-local positions ``[start, start + len(buf))``), in
        order; a view when the padding is at the end, a copy otherwise."""
        if self.wr == self.wl:
            return buf
        if self.outer == 1:
            return buf[:max(0, min(start + buf.numel(), self.wr) - start)]
        pos = torch.arange(start, start + buf.numel(), device=buf.device)
        return buf[(pos % self.wl) < self.wr]


def overlap_runs(target: RankRows, ra: int, rb: int,
                 source: RankRows) -> list[tuple[int, int, int]]:
    """``(source_start, target_offset, length)`` runs: where real-local range ``[ra, rb)`` of
    ``target`` is found in ``source``'s real-local tensor (``target_offset`` counted from ``ra``).
    Elements that ``source`` does not hold are left out."""
    if rb <= ra or target.wr == 0 or source.wr == 0:
        return []
    if (target.col0, target.wr) == (source.col0, source.wr):
        return [(ra, 0, rb - ra)]
    lo, hi = max(target.col0, source.col0), min(target.col0 + target.wr, source.col0 + source.wr)
    if hi <= lo:
        return []
    out: list[list[int]] = []
    for o in range(ra // target.wr, (rb - 1) // target.wr + 1):
        row = o * target.wr
        a = max(lo, max(ra, row) - row + target.col0)
        b = min(hi, min(rb, row + target.wr) - row + target.col0)
        if b > a:
            src, dst = o * source.wr + a - source.col0, row + a - target.col0 - ra
            if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
                out[-1][2] += b - a
            else:
                out.append([src, dst, b - a])
    return [tuple(r) for r in out]


class FragmentReader:
    """Fragments of every shard of a checkpoint directory, indexed by (parameter, source TP rank).

    Args:
        directory: the ``iter_N`` directory.
        meta: its ``metadata.json`` (``grid.tp``, ``params``, ``shards``).

    Raises:
        IncompleteCheckpointError: the fragments of a parameter do not tile its tensor exactly.
    """

    def __init__(self, directory: Path, meta: dict):
        self.meta, self.tp = meta, meta["grid"]["tp"]
        self.files = [safe_open(str(directory / s), framework="pt") for s in meta["shards"]]
        self.index: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        for i, f in enumerate(self.files):
            layout = json.loads(f.metadata()["layout"])
            for name, e in layout.items():
                lo, hi = e["flat_range"]
                t = e["tp_rank"]
                if format1.redundant_fragment(self.meta["params"][name]["split_dim"], t):
                    continue
                if hi > lo:
                    self.index.setdefault((name, t), []).append((lo, hi, i))
        for frags in self.index.values():
            frags.sort()
        self.bytes_read = 0
        """Tensor bytes read so far (``get_slice`` requests; headers not counted)."""
        self.reads = 0
        self._check_coverage(directory)

    def source_rows(self, name: str, t: int) -> RankRows:
        p = self.meta["params"][name]
        tp = self.tp if p["split_dim"] is not None else 1
        return RankRows.of(p["full_shape"], p["split_dim"], p["padded_size"], tp, t)

    def _check_coverage(self, directory: Path) -> None:
        for name, p in self.meta["params"].items():
            for t in range(self.tp if p["split_dim"] is not None else 1):
                end = 0
                for lo, hi, _ in self.index.get((name, t), []):
                    if lo != end:
                        break
                    end = hi
                want = self.source_rows(name, t).real_numel
                if end != want:
                    raise IncompleteCheckpointError(
                        f"{directory}: the fragments of {name} (tp rank {t}) do not tile [0, "
                        f"{want}) (covered up to {end}); the checkpoint is damaged")

    def read_real(self, name: str, kind: str, target: RankRows, ra: int, rb: int,
                  out: torch.Tensor) -> None:
        """Write real-local elements ``[ra, rb)`` of ``target`` (a TP rank of any TP size) of
        ``kind`` into ``out`` (1-D, ``rb - ra`` elements), reading only overlapping bytes."""
        p = self.meta["params"][name]
        for t in range(self.tp if p["split_dim"] is not None else 1):
            frags = self.index.get((name, t), [])
            starts = [f[0] for f in frags]
            want: dict[int, list[tuple[int, int, int]]] = {}
            for src, dst, n in overlap_runs(target, ra, rb, self.source_rows(name, t)):
                i = max(0, bisect.bisect_right(starts, src) - 1)
                while i < len(frags) and frags[i][0] < src + n:
                    lo, hi, _ = frags[i]
                    a, b = max(lo, src), min(hi, src + n)
                    if b > a:
                        want.setdefault(i, []).append((a - lo, dst + a - src, b - a))
                    i += 1
            for i, pieces in want.items():
                self._read_pieces(frags[i][2], f"{kind}/{name}", sorted(pieces), out)

    def _read_pieces(self, shard: int, key: str, pieces, out: torch.Tensor) -> None:
        """Read ``(fragment_offset, out_offset, length)`` pieces (sorted by offset): one
        ``get_slice`` per run of contiguous offsets, cut into reads of at most
        :data:`READ_CHUNK` elements (the staging bound)."""
        sl = self.files[shard].get_slice(key)
        j = 0
        while j < len(pieces):
            k, end = j, pieces[j][0] + pieces[j][2]
            while k + 1 < len(pieces) and pieces[k + 1][0] == end:
                k += 1
                end += pieces[k][2]
            p = j
            for c in range(pieces[j][0], end, READ_CHUNK):
                ce = min(end, c + READ_CHUNK)
                data = sl[c:ce]
                self.bytes_read += data.numel() * data.element_size()
                self.reads += 1
                while p <= k:
                    off, dst, n = pieces[p]
                    a, b = max(off, c), min(off + n, ce)
                    out[dst + a - off:dst + b - off].copy_(data[a - c:b - c])
                    if off + n > ce:
                        break
                    p += 1
                del data
            j = k + 1

    def read_local(self, name: str, kind: str, spec: TPSpec, start: int, stop: int,
                   out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of the flattened padded local tensor of TP rank
        ``spec.tp_rank`` of ``spec.tp_size`` (padding zero) into the 1-D ``out``.

        Raises:
            ValueError: ``spec`` describes another tensor than the saved one.
        """
        p = self.meta["params"][name]
        if (tuple(p["full_shape"]), p["split_dim"]) != (tuple(spec.full_shape), spec.split_dim):
            raise ValueError(f"{name}: saved with full shape {tuple(p['full_shape'])} split along "
                             f"{p['split_dim']}, this model has {tuple(spec.full_shape)} split "
                             f"along {spec.split_dim}")
        rows = RankRows.of_spec(spec)
        ra, rb = rows.real_index(start), rows.real_index(stop)
        if rows.wr == rows.wl:
            self.read_real(name, kind, rows, ra, rb, out)
            return
        out.zero_()
        if rows.outer == 1:  # the padding is at the end of the one row
            self.read_real(name, kind, rows, ra, rb, out[:rb - ra])
            return
        tmp = torch.empty(rb - ra, dtype=out.dtype, device=out.device)
        self.read_real(name, kind, rows, ra, rb, tmp)
        pos = torch.arange(start, stop, device=out.device)
        out[(pos % rows.wl) < rows.wr] = tmp

    def full_tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        """The full unpadded fp32 tensor of parameter ``name`` (reads every fragment of it once)."""
        p = self.meta["params"][name]
        out = torch.empty(p["full_shape"], dtype=torch.float32)
        rows = RankRows.of(p["full_shape"], p["split_dim"], p["full_shape"][p["split_dim"]]
                           if p["split_dim"] is not None else 0, 1, 0)
        self.read_real(name, kind, rows, 0, rows.real_numel, out.view(-1))
        return out
