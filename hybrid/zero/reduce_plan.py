"""The static gradient-reduction plan of the ZeRO engine: which collectives reduce which ranges of
the partition layout, in which order, and which copies fill their inputs (arXiv 1910.02054
§5.2). Pure values and functions: no collective, no tensor; :mod:`hybrid.zero.reduce` runs it."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.zero.layout import PartitionLayout
from hybrid.zero.stage import StagePlan


@dataclass(frozen=True)
class FlatCopy:
    """Copy ``length`` elements from offset ``src`` of one flat buffer to offset ``dst`` of another
    (stage 1: full-flat gradient <-> reduce-scatter staging)."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class GradCopy:
    """Copy ``length`` elements of ``params[param].grad`` (flattened, from ``param_start``) to
    offset ``dst`` of the reduce-scatter input (stage 2/3)."""

    param: int
    param_start: int
    dst: int
    length: int


@dataclass(frozen=True)
class ReduceBucket:
    """One collective of the static reduction plan.

    Attributes:
        start, end: the bucket's range, in the full flat buffer (stage 0) or in the partition
            (stages 1-3: every rank's chunk is ``end - start`` elements).
        units: layout units the bucket touches (it launches once they are all ready).
        copy_in: what fills the reduce-scatter input (``FlatCopy`` at stage 1, ``GradCopy`` at 2/3).
        copy_out: stage 1: where the reduced chunk goes back in the full flat gradient.
    """

    start: int
    end: int
    units: tuple[int, ...]
    copy_in: tuple[FlatCopy | GradCopy, ...] = ()
    copy_out: tuple[FlatCopy, ...] = ()
    gaps: tuple[tuple[int, int], ...] = ()
    """Stage 2/3: ``[a, b)`` ranges of the reduce-scatter input no parameter covers (padding)."""


@dataclass(frozen=True)
class ReducePlan:
    """The static reduction plan of one rank: the same collectives in the same order on every
    rank (only ``copy_out`` differs, by the rank's own shard)."""

    buckets: tuple[ReduceBucket, ...]
    """In launch order (last block first)."""
    chunk: int
    """Elements of every rank's chunk of a staged bucket (0: reduced in place, no staging)."""
    unit_buckets: tuple[int, ...]
    """Per layout unit, how many buckets touch it (its gradients are freed after the last)."""


def reduce_plan(layout: PartitionLayout, plan: StagePlan, dp: int, rank: int,
                bucket_size: int) -> ReducePlan:
    """The buckets data-parallel rank ``rank`` of ``dp`` reduces, for the stage's ``plan``.

    In place (stage 0; stage 1 by all-reduce): ranges of the full flat buffer of about
    ``bucket_size`` elements. Otherwise every bucket is a range of the partition of ``chunk =
    min(bucket_size // dp, partition_numel)`` elements whose reduce-scatter input gathers, for
    each rank ``r``, rank ``r``'s shard of the same range (from the full flat gradient at stage
    1, from the parameters' ``.grad`` at stages 2/3). No collective, no tensor.
    """
    L = layout
    if plan.grad_in_place:
        buckets = tuple(ReduceBucket(a, b, tuple(L.units_of_flat(a, b)))
                        for a, b in L.flat_buckets(bucket_size))
        chunk = 0
    else:
        chunk = min(max(1, bucket_size // dp), L.partition_numel)
        buckets = tuple(_staged_bucket(L, a, b, dp, rank, plan.shards_gradients)
                        for a, b in L.reduce_buckets(chunk))
    unit_buckets = [0] * len(L.units)
    for bucket in buckets:
        for u in bucket.units:
            unit_buckets[u] += 1
    return ReducePlan(buckets, chunk, tuple(unit_buckets))


def _staged_bucket(L: PartitionLayout, a: int, b: int, dp: int, rank: int,
                   from_params: bool) -> ReduceBucket:
    """Partition range ``[a, b)`` as one staged bucket: rank ``r``'s shard of it lands at
    ``[r * (b - a), (r + 1) * (b - a))`` of the reduce-scatter input."""
    n, ins, outs, units = b - a, [], [], []
    q = 0
    for pc in L.pieces(a, b):
        u = L.units[pc.unit]
        units.append(pc.unit)
        length = pc.hi - pc.lo
        for r in range(dp):
            src = u.offset + r * u.shard + pc.lo
            if not from_params:
                ins.append(FlatCopy(src, r * n + q, length))
            else:
                ins.extend(GradCopy(s, ps, r * n + q + rel, ln)
                           for s, ps, ln, rel in L.segments(src, length))
        outs.append(FlatCopy(q, u.offset + rank * u.shard + pc.lo, length))
        q += length
    gaps = _gaps(ins, dp * n) if from_params else ()
    return ReduceBucket(a, b, tuple(units), tuple(ins), tuple(outs), gaps)


def _gaps(copies, total: int) -> tuple[tuple[int, int], ...]:
    """``[a, b)`` ranges of ``[0, total)`` that no copy's destination covers."""
    out, at = [], 0
    for c in sorted(copies, key=lambda c: c.dst):
        if c.dst > at:
            out.append((at, c.dst))
        at = max(at, c.dst + c.length)
    if at < total:
        out.append((at, total))
    return tuple(out)


def unit_reduce_plan(layout: PartitionLayout) -> ReducePlan:
    """Stage 1 with gradient-accumulation fusion: one reduce-scatter per unit, last unit first,
    straight from the full flat gradient (a unit's ``dp`` shards lie rank-major there, so the
    unit is the collective's input and this rank's shard its output). No collective, no tensor.
    A unit may exceed the reduce bucket size (as Megatron-LM lets one large parameter exceed
    its bucket)."""
    buckets = tuple(ReduceBucket(u.part_offset, u.part_offset + u.shard, (u.index,))
                    for u in reversed(layout.units))
    return ReducePlan(buckets, 0, tuple(1 for _ in layout.units))
