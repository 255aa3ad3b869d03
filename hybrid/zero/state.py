"""Export and import of a :class:`hybrid.zero.engine.ZeroEngine`'s state, partition by partition.

The checkpoint path (:mod:`hybrid.checkpoint.shards`) uses the partition-wise functions: a rank
hands out views of the fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` it owns
(:func:`owned_state`, no copy and no collective) and fills its own partition from whatever
supplies the values (:func:`import_state`). Ownership is the engine's
:class:`hybrid.zero.layout.PartitionLayout`: data-parallel rank ``r`` owns ``layout.fragments(r)``.
Stage 0 holds everything on every rank, and its ranks still *write* only
``layout.fragments(r)``, so the writing is split the same way as at stages 1-3 (ZeRO paper
arXiv:1910.02054, §5: each rank keeps 1/N_d of the optimizer states).

The ``*_by_name`` functions build whole TP-local tensors with an all-gather over dp: they are
for tests and small-model tools, never for checkpoints (a full fp32 copy per kind per rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from hybrid.parallel.tp_spec import TPSpec, get_tp_spec
from hybrid.parallel.tp_weights import gather_full_tensor
from hybrid.zero.layout import Fragment, ParamSlot

KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The fp32 model states a checkpoint holds per parameter (ZeRO paper §3.1: K = 12 bytes/param)."""


@dataclass(frozen=True)
class OwnedFragment:
    """Elements ``[start, stop)`` of a flattened TP-local parameter that this rank holds."""

    slot: ParamSlot
    spec: TPSpec
    start: int
    stop: int
    views: dict[str, torch.Tensor]
    """``{kind: 1-D fp32 view of the engine's buffer}`` of ``stop - start`` elements."""


def _domain_offset(engine, f: Fragment) -> int:
    return f.part_offset if engine.plan.shards_optimizer_states else f.flat_offset


def _views(engine, f: Fragment) -> dict[str, torch.Tensor]:
    o = _domain_offset(engine, f)
    return {k: getattr(engine.states, k)[o:o + f.length] for k in KINDS}


def owned_state(engine) -> Iterator[OwnedFragment]:
    """This rank's share of the model states to write, in flat order (not collective).

    Stages 1-3: the fragments of the partition it owns. Stage 0: the same fragments, cut out of
    its full copy. Each parameter lies in at most one fragment per rank; views alias the
    engine's buffers (valid until its next ``step``). In-flight ``--overlap-param-gather``
    all-gathers are waited for first (a checkpoint reads a settled state)."""
    engine.wait_param_gather()
    for f in engine.layout.fragments(engine.dp_rank):
        slot = engine.layout.slots[f.slot]
        yield OwnedFragment(slot, get_tp_spec(engine.params[slot.index]), f.param_start,
                            f.param_start + f.length, _views(engine, f))


def optimizer_step(engine) -> int:
    """AdamW's step count (the same for every parameter)."""
    if engine.opt_params:
        return int(engine.optimizer.state[engine.opt_params[0][0]]["step"].item())
    return engine.optimizer_steps


Fill = Callable[[ParamSlot, TPSpec, int, int, str, torch.Tensor], None]
"""``fill(slot, spec, start, stop, kind, out)`` writes elements ``[start, stop)`` of the
flattened TP-local parameter's ``kind`` state into the 1-D fp32 tensor ``out``."""


@torch.no_grad()
def import_state(engine, fill: Fill, step: int, load_optim: bool = True) -> None:
    """Fill every fragment the optimizer of this rank updates (stage 0: whole parameters) from
    ``fill``, set AdamW's step, then refresh the compute-dtype parameters (collective over dp
    for stages 1-3, like a ``step``). With ``load_optim=False`` only ``master`` is filled;
    the moments are zeroed.
    """
    engine.wait_param_gather()
    for mp, f in engine.opt_params:
        slot = engine.layout.slots[f.slot]
        spec = get_tp_spec(engine.params[slot.index])
        for kind, view in _views(engine, f).items():
            if kind == "master" or load_optim:
                fill(slot, spec, f.param_start, f.param_start + f.length, kind, view)
            else:
                view.zero_()
        engine.optimizer.state[mp]["step"].fill_(float(step))
    engine.optimizer_steps = int(step)
    engine.refresh_params()


# ---- whole-tensor views (tests, small tools: all-gather over dp) ------------------------------
@torch.no_grad()
def full_flat(engine, domain: torch.Tensor) -> torch.Tensor:
    """All-gather a partition-shaped buffer (a tensor, or an offloaded
    :class:`hybrid.zero.offload.SplitFlat`) into full flat order on the training device
    (collective over dp)."""
    engine.wait_param_gather()
    if not engine.plan.shards_optimizer_states:
        return domain
    L, dev = engine.layout, engine.grid.device  # offloaded states gather from the device
    out = torch.empty(L.total_numel, dtype=domain.dtype, device=dev)
    for u in L.units:
        engine.comm.all_gather(out[u.offset:u.offset + u.padded],
                               domain[u.part_offset:u.part_offset + u.shard].to(dev).contiguous(),
                               kind="state_all_gather").wait()
    return out


def _by_name(engine, flats: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {s.name: {k: v[s.offset:s.offset + s.numel].view(s.shape).clone()
                     for k, v in flats.items()}
            for s in engine.layout.slots}


def optimizer_state_by_name(engine) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {"master", "exp_avg", "exp_avg_sq", "step"}}``: fp32 tensors with the shape of
    this TP rank's local parameter (not partitioned over dp, no ZeRO padding; the TP padding of
    vocabulary rows is part of the local shape); ``step`` is a 0-d tensor. Collective over dp."""
    out = _by_name(engine, {k: full_flat(engine, getattr(engine.states, k)) for k in KINDS})
    step = optimizer_step(engine)
    for entry in out.values():
        entry["step"] = torch.tensor(float(step))
    return out


@torch.no_grad()
def load_optimizer_state_by_name(engine, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Inverse of :func:`optimizer_state_by_name` (any data-parallel size produced it).

    Raises:
        KeyError: names missing from or unknown to ``state``.
        ValueError: a tensor's shape differs from the local parameter's.
    """
    names = {s.name for s in engine.layout.slots}
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise KeyError(f"optimizer state mismatch: missing {missing}, unexpected {unexpected}")
    for s in engine.layout.slots:
        for k in KINDS:
            if tuple(state[s.name][k].shape) != s.shape:
                raise ValueError(f"{s.name}.{k}: shape {tuple(state[s.name][k].shape)}, "
                                 f"expected {s.shape}")

    def fill(slot, spec, start, stop, kind, out):
        out.copy_(state[slot.name][kind].reshape(-1)[start:stop])

    import_state(engine, fill, int(next(iter(state.values()))["step"]))


def gradients_by_name(engine) -> dict[str, torch.Tensor]:
    """The reduced fp32 gradients of the finished micro-batches (after the last micro-batch's
    backward, before ``step``): ``{name: TP-local tensor}``, averaged over dp, loss scale still
    applied for fp16. Collective over dp.

    Raises:
        RuntimeError: called before a ``backward(..., is_last_micro_batch=True)``.
    """
    if not engine.grads_ready:
        raise RuntimeError(
            "gradients_by_name() needs a backward(..., is_last_micro_batch=True) first")
    grads, L = engine.reducer.buffer, engine.layout
    plan = engine.plan
    if plan.shards_optimizer_states and not plan.shards_gradients:
        # a full-size buffer in which only the owned shards hold the dp sum
        owned = grads.new_empty(L.partition_numel)
        for u in L.units:
            start = u.offset + engine.grid.dp_rank * u.shard
            owned[u.part_offset:u.part_offset + u.shard] = grads[start:start + u.shard]
        grads = owned
    full = full_flat(engine, grads) if plan.shards_optimizer_states else grads
    return {k: v["grad"] for k, v in _by_name(engine, {"grad": full}).items()}


def model_state_dict_full(engine) -> dict[str, torch.Tensor]:
    """The full single-process fp32 state dict (from the master weights), identical on every
    rank. Collective over dp and tp."""
    flat = full_flat(engine, engine.states.master)
    return {s.name: gather_full_tensor(flat[s.offset:s.offset + s.numel].view(s.shape),
                                       get_tp_spec(engine.params[s.index]), engine.grid.tp_group)
            for s in engine.layout.slots}
