"""The ZeRO engine's flat storage, built and filled one unit at a time.

A rank holds, per :class:`hybrid.zero.layout.PartitionLayout` (ZeRO paper §5, arXiv:1910.02054):

- ``master``: fp32 weights the optimizer updates (the partition for stages 1-3, the full flat
  buffer for stage 0), and the two Adam moments of the same shape;
- compute-dtype parameters: the full flat buffer ``param_flat`` (stages 0-2), or for stage 3
  this rank's shard ``param_shard`` plus one per-unit buffer that is allocated only while the
  unit is gathered (persistent units stay allocated).

These are allocated once, at their steady-state size, and then filled unit by unit (the root
unit, then each transformer block) from a *weight source*: the unit's parameters are
materialised in fp32 one unit at a time, its owned range is copied into ``master`` and into the
compute-dtype storage, and the unit is freed before the next. No rank ever holds a second full
copy of the model: the construction peak is the steady state plus one unit in fp32 (plus, for
a seeded initialisation with tp > 1, the largest full parameter the generator draws).

A weight source is ``source(name, param) -> tensor``: the TP-local value (shape
``param.shape``, any floating dtype) of the parameter with the clean name ``name``
(``layers.0.attn.qkv.weight``), given the model's parameter (possibly on ``meta``; its
``tp_spec`` says how it is sharded). ``hybrid.parallel.tp_weights.seeded_weights`` (the same values
as ``GPT.init_weights(seed)``) and ``hybrid.parallel.tp_weights.full_weights`` (a full state dict,
for ``--finetune``) make one; :func:`model_weights` reads a materialised model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybrid.zero.layout import PartitionLayout
from hybrid.zero.offload import SplitFlat
from hybrid.zero.stage import StagePlan

WeightSource = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class FlatStates:
    """The buffers one rank keeps (1-D; element counts from the layout)."""

    master: torch.Tensor | SplitFlat
    """fp32 ``[partition_numel]`` (stages 1-3) or ``[total_numel]`` (stage 0); with offload a
    :class:`hybrid.zero.offload.SplitFlat` (sliced the same way, unit by unit)."""
    exp_avg: torch.Tensor | SplitFlat
    """fp32, the shape of ``master``."""
    exp_avg_sq: torch.Tensor | SplitFlat
    """fp32, the shape of ``master``."""
    param_flat: torch.Tensor | None
    """Compute dtype ``[total_numel]`` (stages 0-2), else None."""
    param_shard: torch.Tensor | None
    """Compute dtype ``[partition_numel]`` (stage 3), else None."""
    unit_bufs: list[torch.Tensor]
    """Per unit, its ``[padded]`` compute-dtype buffer (a view of ``param_flat`` for stages
    0-2; for stage 3 its own tensor, with no storage unless the unit is persistent)."""


def model_weights(params: list[torch.Tensor]) -> WeightSource:
    """A source reading the current values of a materialised model (``params`` in layout
    order, looked up by identity so that names with wrapper prefixes do not matter)."""
    def source(name: str, param: torch.Tensor) -> torch.Tensor:
        if param.is_meta:
            raise ValueError(f"parameter {name} is on the meta device: pass a weight source "
                             "(e.g. hybrid.parallel.tp_weights.seeded_weights) to build it")
        return param.detach()

    return source


@torch.no_grad()
def allocate_states(layout: PartitionLayout, plan: StagePlan, dtype: torch.dtype,
                    device: torch.device, host_split: int = 0) -> FlatStates:
    """Zero-filled steady-state buffers, parameters in the compute ``dtype``; stage 3's
    non-persistent unit buffers are created without storage (the parameter views are bound by
    :func:`bind_parameters`). With ``host_split`` > 0 (stages 1-3, ``--optimizer-cpu-offload``)
    the master and moments are :class:`hybrid.zero.offload.SplitFlat`: ``[0, host_split)`` in
    host memory."""
    L = layout
    domain = L.partition_numel if plan.shards_optimizer_states else L.total_numel
    if host_split:
        master, exp_avg, exp_avg_sq = (SplitFlat(domain, host_split, device) for _ in range(3))
    else:
        master, exp_avg, exp_avg_sq = (torch.zeros(domain, dtype=torch.float32, device=device)
                                       for _ in range(3))
    param_flat = param_shard = None
    if not plan.shards_parameters:
        param_flat = torch.zeros(L.total_numel, dtype=dtype, device=device)
        bufs = [param_flat[u.offset:u.offset + u.padded] for u in L.units]
    else:
        param_shard = torch.zeros(L.partition_numel, dtype=dtype, device=device)
        bufs = [torch.zeros(u.padded, dtype=dtype, device=device) if u.persistent
                else _unallocated(u.padded, dtype, device) for u in L.units]
    return FlatStates(master, exp_avg, exp_avg_sq, param_flat, param_shard, bufs)


def _unallocated(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(n, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


@torch.no_grad()
def fill_units(states: FlatStates, layout: PartitionLayout, plan: StagePlan, dp_rank: int,
               params: list[torch.Tensor], source: WeightSource, units=None) -> None:
    """Set the fp32 master weights and the compute-dtype parameters of ``units`` (default:
    all, in flat order) from ``source``, one unit at a time; no collective, every rank reads
    what it needs from the source. The Adam moments are not touched.

    Args:
        params: the model's parameters in layout order (shapes and ``tp_spec`` for the source).

    Raises:
        ValueError: the source returned a tensor whose shape differs from the parameter's.
    """
    L = layout
    for ui in range(len(L.units)) if units is None else units:
        u = L.units[ui]
        unit = torch.zeros(u.padded, dtype=torch.float32, device=states.unit_bufs[ui].device)
        for si in u.slots:
            s = L.slots[si]
            value = source(s.name, params[si])
            if tuple(value.shape) != s.shape:
                raise ValueError(f"{s.name}: the weight source gave shape {tuple(value.shape)}, "
                                 f"expected the local shape {s.shape}")
            unit[s.offset - u.offset:s.offset - u.offset + s.numel].copy_(value.reshape(-1))
            del value
        own = unit[dp_rank * u.shard:(dp_rank + 1) * u.shard]
        if not plan.shards_optimizer_states:
            states.master[u.offset:u.offset + u.padded].copy_(unit)
        else:
            states.master[u.part_offset:u.part_offset + u.shard].copy_(own)
        if plan.shards_parameters:
            states.param_shard[u.part_offset:u.part_offset + u.shard].copy_(own)
        buf = states.unit_bufs[ui]
        if not plan.shards_parameters or u.persistent:
            buf.copy_(unit)
        elif buf.untyped_storage().nbytes():  # a gathered stage-3 unit: keep it consistent
            buf.copy_(unit)
        del unit, own


@torch.no_grad()
def bind_parameters(model: nn.Module, layout: PartitionLayout, params: list[torch.Tensor],
                    unit_bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Make every parameter a view of its unit buffer; returns the parameters in layout order.

    A materialised parameter on the buffers' device keeps its identity (``param.data`` is
    replaced); a ``meta`` one (or one on another device) is replaced on its module(s) by a new
    ``nn.Parameter`` carrying the same attributes (``tp_spec``), tied parameters staying tied.
    Stage 3's unallocated unit buffers are given storage for the binding and released again.
    """
    L = layout
    new: dict[int, torch.Tensor] = {}
    out = list(params)
    for u in L.units:
        buf = unit_bufs[u.index]
        empty = buf.untyped_storage().nbytes() == 0
        if empty:
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        for si in u.slots:
            s, p = L.slots[si], params[si]
            view = buf[s.offset - u.offset:s.offset - u.offset + s.numel].view(s.shape)
            if not p.is_meta and p.device == view.device:
                p.data = view
            else:
                # ``.data =`` (not ``nn.Parameter(view)``): the parameter keeps its own version
                # counter, so stage 3's in-place gathers into the unit buffer do not invalidate
                # what autograd saved from it.
                q = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                 requires_grad=p.requires_grad)
                q.data = view
                q.__dict__.update({k: v for k, v in p.__dict__.items() if k not in q.__dict__})
                new[id(p)] = q
                out[si] = q
        if empty:
            buf.untyped_storage().resize_(0)
    if new:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in new:
                    module._parameters[name] = new[id(p)]
    return out


def check_materialised(model: nn.Module) -> None:
    """Raise ``ValueError`` naming a buffer still on ``meta`` (ZeRO only owns parameters)."""
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer {name} is on the meta device; materialise buffers before "
                             "building the ZeRO engine")
