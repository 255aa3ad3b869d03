"""The one partition layout of a ZeRO engine: offsets, padding and owners, computed once.

Parameters (this TP rank's local shards) are grouped into *units*: stage 3 gathers one unit at
a time (a transformer block ``layers.{i}``, or the ``root`` unit of everything outside the
blocks: embeddings, final norm, untied head), and every stage uses the same units so that one
layout serves them all. Stage 3 may also put small parameters into one ``persistent`` unit that
is never released. A unit's parameters lie back to back in the *full flat* order; the unit is
zero-padded to a multiple of ``dp * align`` and cut into ``dp`` equal contiguous *shards*::

    full flat:   | unit 0: shard r0 | r1 | ... | unit 1: shard r0 | r1 | ... |
    partition r: | unit 0 shard r | unit 1 shard r | ...                       (partition coords)

Rank ``r`` owns shard ``r`` of every unit: its fp32 master weights, Adam moments and (stage
2/3) gradients live in a flat *partition* buffer that concatenates those shards. A parameter
may straddle two shards; the parts a rank owns are its :class:`Fragment` s. Because every rank
owns a slice of every unit, a unit can be gathered or reduce-scattered on its own.

Everything here is an immutable value; nothing else re-derives offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from hybrid.parallel.tp_spec import get_tp_spec

ROOT = "root"
PERSISTENT = "persistent"
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name without wrapper prefixes (activation-checkpoint / compile wrappers)."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: biases and LayerNorm weights (every 1-D parameter) get no weight decay.

    Embedding and position tables are 2-D and do decay."""
    return param.dim() < 2 or name.endswith("bias")


EMBEDDING_OR_OUTPUT = ("wte.weight", "lm_head.weight")
"""The word embedding and the untied output layer: Megatron-LM's
``is_embedding_or_output_parameter`` (``--decoupled-lr`` trains them at their own rate); a
learned position table is not one of them."""


def is_embedding_or_output(name: str) -> bool:
    """Whether parameter ``name`` is in :data:`EMBEDDING_OR_OUTPUT`."""
    return name in EMBEDDING_OR_OUTPUT


@dataclass(frozen=True)
class ParamSlot:
    """One local parameter in the full flat order."""

    name: str
    index: int
    """Position in ``model.named_parameters()`` (the engine's parameter list)."""
    unit: int
    shape: tuple[int, ...]
    numel: int
    offset: int
    """First element in the full flat buffer."""
    tp_replicated: bool
    """Identical on every TP rank (counted in the grad norm on TP rank 0 only)."""
    no_decay: bool


@dataclass(frozen=True)
class Unit:
    """A group of parameters gathered / reduced together, padded to ``dp`` equal shards."""

    name: str
    index: int
    slots: tuple[int, ...]
    offset: int
    """First element in the full flat buffer."""
    numel: int
    """Real elements (sum of the parameters')."""
    padded: int
    """``numel`` rounded up to a multiple of ``dp * align``."""
    shard: int
    """``padded // dp``: elements each rank owns."""
    part_offset: int
    """Where this unit's shard starts in every rank's partition buffer."""
    persistent: bool


@dataclass(frozen=True)
class Fragment:
    """The part ``[param_start, param_start + length)`` of a flattened parameter that sits at
    ``flat_offset`` in the full flat buffer and at ``part_offset`` in a rank's partition."""

    slot: int
    param_start: int
    length: int
    flat_offset: int
    part_offset: int


@dataclass(frozen=True)
class Piece:
    """``[lo, hi)`` of unit ``unit``'s shard coordinates (same range on every rank)."""

    unit: int
    lo: int
    hi: int


class PartitionLayout:
    """Immutable layout of one TP rank's parameters over its data-parallel group.

    Args:
        entries: ``(name, shape, tp_replicated, no_decay, unit_name)`` in parameter order.
        unit_order: unit names in flat order.
        dp: data-parallel size.
        align: each unit is padded to a multiple of ``dp * align`` elements.
        persistent_units: names of units that stage 3 never releases.
    """

    def __init__(self, entries, unit_order, dp: int, align: int = 8,
                 persistent_units: tuple[str, ...] = ()):
        if dp < 1 or align < 1:
            raise ValueError(f"dp={dp} and align={align} must be >= 1")
        self.dp, self.align = dp, align
        by_unit: dict[str, list[int]] = {u: [] for u in unit_order}
        for i, e in enumerate(entries):
            if e[4] not in by_unit:
                raise ValueError(f"parameter {e[0]} is in unknown unit {e[4]!r}")
            by_unit[e[4]].append(i)
        slots: list[ParamSlot | None] = [None] * len(entries)
        units: list[Unit] = []
        flat = part = 0
        for uname in unit_order:
            members = by_unit[uname]
            if not members:
                continue
            uidx, start = len(units), flat
            for i in members:
                name, shape, rep, nod, _ = entries[i]
                n = 1
                for d in shape:
                    n *= d
                slots[i] = ParamSlot(name, i, uidx, tuple(shape), n, flat, rep, nod)
                flat += n
            numel = flat - start
            q = dp * align
            padded = max(q, -(-numel // q) * q)
            units.append(Unit(uname, uidx, tuple(members), start, numel, padded, padded // dp,
                              part, uname in persistent_units))
            flat = start + padded
            part += padded // dp
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.units: tuple[Unit, ...] = tuple(units)
        self.total_numel = flat
        """Padded length of the full flat buffer."""
        self.partition_numel = part
        """Length of every rank's partition buffer (``total_numel // dp``)."""
        self.numel = sum(s.numel for s in self.slots)
        """Real (unpadded) local parameter elements: Psi of this TP rank."""
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"PartitionLayout is immutable (tried to set {name!r})")
        super().__setattr__(name, value)

    @classmethod
    def from_model(cls, model: nn.Module, dp: int, persistence_threshold: int = 0,
                   align: int = 8) -> PartitionLayout:
        """Units: ``persistent`` (params with numel < threshold, stage 3 only), ``root``, then
        one per ``model.layers[i]`` (membership by module, so wrappers do not matter)."""
        layer_of = {}
        for i, block in enumerate(getattr(model, "layers", [])):
            for p in block.parameters():
                layer_of[id(p)] = f"layers.{i}"
        entries = []
        for name, p in model.named_parameters():
            unit = layer_of.get(id(p), ROOT)
            if p.numel() < persistence_threshold:
                unit = PERSISTENT
            spec = get_tp_spec(p)
            entries.append((clean_name(name), tuple(p.shape), spec.replicated,
                            no_weight_decay(name, p), unit))
        blocks = range(len(getattr(model, "layers", [])))
        order = [PERSISTENT, ROOT] + [f"layers.{i}" for i in blocks]
        return cls(entries, order, dp, align, persistent_units=(PERSISTENT,))

    # ---- ownership ------------------------------------------------------------------------
    def shard_range(self, unit: int, rank: int) -> tuple[int, int]:
        """Full-flat ``[start, stop)`` of ``rank``'s shard of ``unit``."""
        u = self.units[unit]
        return u.offset + rank * u.shard, u.offset + (rank + 1) * u.shard

    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        """Every non-empty part of a parameter that ``rank`` owns, in flat order."""
        out = []
        for u in self.units:
            a, b = self.shard_range(u.index, rank)
            for s in u.slots:
                slot = self.slots[s]
                lo, hi = max(a, slot.offset), min(b, slot.offset + slot.numel)
                if hi > lo:
                    out.append(Fragment(s, lo - slot.offset, hi - lo, lo, u.part_offset + lo - a))
        return tuple(out)

    def whole_fragments(self) -> tuple[Fragment, ...]:
        """Each parameter whole, with ``part_offset = flat_offset`` (stage 0's optimizer domain)."""
        return tuple(Fragment(s.index, 0, s.numel, s.offset, s.offset) for s in self.slots)

    def segments(self, flat_start: int, length: int) -> list[tuple[int, int, int, int]]:
        """Parameters overlapping the full-flat range: ``(slot, param_start, length, rel)`` with
        ``rel`` the offset inside the range (the rest of the range is padding)."""
        out = []
        end = flat_start + length
        for s in self.slots:
            lo, hi = max(flat_start, s.offset), min(end, s.offset + s.numel)
            if hi > lo:
                out.append((s.index, lo - s.offset, hi - lo, lo - flat_start))
        return out

    # ---- buckets --------------------------------------------------------------------------
    def pieces(self, a: int, b: int) -> tuple[Piece, ...]:
        """Partition-coordinate range ``[a, b)`` as per-unit shard ranges, in order."""
        out = []
        for u in self.units:
            lo, hi = max(a, u.part_offset), min(b, u.part_offset + u.shard)
            if hi > lo:
                out.append(Piece(u.index, lo - u.part_offset, hi - u.part_offset))
        return tuple(out)

    def reduce_buckets(self, chunk: int) -> tuple[tuple[int, int], ...]:
        """Partition ranges of at most ``chunk`` elements per rank, from the end backwards
        (gradients become ready last block first)."""
        return _backward_ranges(self.partition_numel, chunk)

    def flat_buckets(self, size: int) -> tuple[tuple[int, int], ...]:
        """Full-flat ranges of at most ``size`` elements from the end backwards (stage 0)."""
        return _backward_ranges(self.total_numel, size)

    def units_of_flat(self, a: int, b: int) -> tuple[int, ...]:
        """Units overlapping the full-flat range ``[a, b)``."""
        return tuple(u.index for u in self.units if u.offset < b and a < u.offset + u.padded)

    def unit_chunks(self, unit: int, chunk: int) -> tuple[tuple[int, int], ...]:
        """``unit``'s shard cut into ranges of at most ``chunk`` elements (all-gather buckets)."""
        s, chunk = self.units[unit].shard, max(1, chunk)
        return tuple((lo, min(s, lo + chunk)) for lo in range(0, s, chunk))

    def __repr__(self) -> str:
        return (f"PartitionLayout(dp={self.dp}, units={len(self.units)}, params={len(self.slots)}, "
                f"numel={self.numel}, padded={self.total_numel}, partition={self.partition_numel})")


def _backward_ranges(total: int, size: int) -> tuple[tuple[int, int], ...]:
    """``[a, b)`` ranges of at most ``size`` elements tiling ``[0, total)``, last range first."""
    size = max(1, size)
    out, b = [], total
    while b > 0:
        a = max(0, b - size)
        out.append((a, b))
        b = a
    return tuple(out)
