"""The ZeRO engine: data parallelism with partitioned model states (ZeRO paper, §5) over the
data-parallel group of a :class:`hybrid.parallel.grid.ProcessGrid`, on each TP rank's own shard.

Usage (one optimizer step of ``m`` micro-batches)::

    engine = ZeroEngine(model, grid, ZeroConfig(stage=2, precision="bf16"), OptimizerConfig(lr=3e-4))
    for i, (tokens, labels) in enumerate(micro_batches):
        loss = engine.model(tokens, labels).mean() / m
        engine.backward(loss, is_last_micro_batch=(i == m - 1))
    info = engine.step(lr)          # info.skipped, info.grad_norm, info.loss_scale

Pieces (one concept per file): :mod:`hybrid.zero.layout` (the one partition layout),
:mod:`hybrid.zero.reduce` (fp32 accumulation and bucketed gradient reduction),
:mod:`hybrid.zero.stage3` (parameter gathering), :mod:`hybrid.zero.grad_norm` (the one norm),
:mod:`hybrid.zero.loss_scaler`, :mod:`hybrid.zero.comm` (collectives with a byte ledger).

What each stage keeps on a rank, with Psi this TP rank's parameter count (padded to the layout)
and n the data-parallel size, in bytes for 16-bit training (``memory_bytes``):

    ============  =========  ==========  ========  ==========
    stage         params     grads       master    optimizer
    ============  =========  ==========  ========  ==========
    0             2 Psi      4 Psi       4 Psi     8 Psi
    1             2 Psi      4 Psi       4 Psi/n   8 Psi/n
    2             2 Psi      4 Psi/n     4 Psi/n   8 Psi/n
    3             2 Psi/n    4 Psi/n     4 Psi/n   8 Psi/n
    ============  =========  ==========  ========  ==========

The paper (§3.1, §5) counts 2 bytes of gradient; we keep gradients in fp32 (4 bytes) because
micro-batches accumulate in fp32. In fp32 training ``params`` is 4 bytes per element and the
fp32 master is a separate copy, so the sum is 20 Psi (stage 0) instead of 16 Psi. Stage 3 keeps
persistent (small) parameters whole, and gathers units transiently (``gathered_peak``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from hybrid.parallel.layers import get_tp_spec
from hybrid.parallel.tp_plan import gather_full_tensor
from hybrid.zero import storage
from hybrid.zero.comm import DPComm
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from hybrid.zero.grad_norm import clip_coefficient, global_grad_norm
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.reduce import GradReducer
from hybrid.zero.stage3 import ParamGatherer

__all__ = ["OptimizerConfig", "StepInfo", "ZeroConfig", "ZeroEngine"]

ALIGN = 8
"""Units are padded to a multiple of ``dp * ALIGN`` elements (16-byte aligned 16-bit shards)."""


@dataclass
class StepInfo:
    """Outcome of one :meth:`ZeroEngine.step`."""

    skipped: bool
    """The gradients overflowed somewhere in the world; nothing but the loss scale changed."""
    grad_norm: float
    """Global L2 norm of the (unscaled) gradient before clipping; inf when overflowed."""
    loss_scale: float
    """The loss scale to use for the next step (1.0 unless fp16)."""
    comm_bytes: dict = field(default_factory=dict)
    """Bytes this rank moved per collective kind during this iteration (see ``comm_bytes``)."""


class ZeroEngine:
    """ZeRO stage 0-3 over ``grid.dp_group`` for a (tensor-parallel) model.

    Args:
        model: the (tensor-parallel) model, every parameter carrying a ``tp_spec``: on
            ``meta`` (built unit by unit from ``weights``) or materialised on ``grid.device``;
            its parameters become views of the engine's buffers in the training precision.
        grid: the process grid (its data-parallel group partitions, the world reduces norms).
        zero_config: stage, buckets, overlap, precision and loss scaling.
        optimizer_config: AdamW hyper-parameters and clipping.
        weights: the initial weights (:mod:`hybrid.zero.storage`), e.g.
            ``hybrid.parallel.tp_plan.seeded_weights(config, seed)``; None reads the model's own
            (materialised) parameters.

    Raises:
        ValueError: a meta parameter without ``weights``, a meta buffer, a wrong source shape.
    """

    def __init__(self, model: nn.Module, grid, zero_config: ZeroConfig,
                 optimizer_config: OptimizerConfig, weights: storage.WeightSource | None = None):
        zero_config.validate()
        optimizer_config.validate()
        self.model, self.grid = model, grid
        self.config, self.opt_config = zero_config, optimizer_config
        self.stage, self.dtype = zero_config.stage, zero_config.dtype
        self.comm = DPComm(grid.dp_group)
        self.dp, self.dp_rank = self.comm.size, self.comm.rank
        self.params = [p for _, p in model.named_parameters()]
        threshold = zero_config.param_persistence_threshold if self.stage == 3 else 0
        self.layout = L = PartitionLayout.from_model(model, self.dp, threshold, ALIGN)
        self.own = L.fragments(self.dp_rank)
        self.opt_frags = L.whole_fragments() if self.stage == 0 else self.own
        self._in_backward = False
        self._grads_ready = False
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self.last_comm_bytes: dict = {}
        self._build_buffers(weights)
        self.reducer = GradReducer(
            self.params, L, self.stage, self.comm, zero_config.reduce_bucket_size,
            zero_config.overlap_comm, on_unit_ready=self._on_unit_ready)
        self.gatherer = None
        if self.stage == 3:
            self.gatherer = ParamGatherer(model, L, self.unit_bufs, self.param_shard, self.comm,
                                          self.ag_chunk, lambda: self._in_backward)
        self._build_optimizer()
        counted = [f for f in self.own
                   if not L.slots[f.slot].tp_replicated or grid.tp_rank == 0]
        self._norm_counted = [self.reducer.grad_view(f) for f in counted]
        fp16 = zero_config.precision == "fp16"
        self.scaler = LossScaler(
            zero_config.loss_scale if zero_config.loss_scale is not None
            else (2.0 ** zero_config.initial_loss_scale_power if fp16 else 1.0),
            dynamic=fp16 and zero_config.loss_scale is None, window=zero_config.loss_scale_window,
            hysteresis=zero_config.hysteresis, min_scale=zero_config.min_loss_scale)
        self._scale_loss = fp16

    # ---- construction ------------------------------------------------------------------------
    @torch.no_grad()
    def _build_buffers(self, weights: storage.WeightSource | None) -> None:
        """Steady-state buffers, filled unit by unit (:mod:`hybrid.zero.storage`): the
        construction peak is the model states plus one unit in fp32, never a second full copy."""
        L, dev = self.layout, self.grid.device
        storage.check_materialised(self.model)
        st = storage.allocate_states(L, self.stage, self.dtype, dev)
        storage.fill_units(st, L, self.stage, self.dp_rank, self.params,
                           weights or storage.model_weights(self.params))
        self.params = storage.bind_parameters(self.model, L, self.params, st.unit_bufs)
        self.master, self.exp_avg, self.exp_avg_sq = st.master, st.exp_avg, st.exp_avg_sq
        self.param_flat, self.param_shard, self.unit_bufs = st.param_flat, st.param_shard, st.unit_bufs
        self.ag_chunk = max(1, self.config.allgather_bucket_size // self.dp)
        self._ag_staging = (torch.empty(min(self.ag_chunk, L.partition_numel), dtype=self.dtype,
                                        device=dev) if self.stage in (1, 2, 3) else None)

    def load_weights(self, weights: storage.WeightSource, units=None) -> None:
        """Set the fp32 master and the compute-dtype parameters from ``weights`` one unit at a
        time, without collectives (``units``: indices into ``layout.units``, default all); the
        Adam moments are unchanged. ``--finetune`` weights enter this way, like initial ones.

        Raises:
            ValueError: a source tensor's shape differs from the local parameter's.
        """
        st = storage.FlatStates(self.master, self.exp_avg, self.exp_avg_sq, self.param_flat,
                                self.param_shard, self.unit_bufs)
        storage.fill_units(st, self.layout, self.stage, self.dp_rank, self.params, weights, units)

    def _build_optimizer(self) -> None:
        L, oc = self.layout, self.opt_config
        groups: dict[bool, list] = {False: [], True: []}
        self._opt_params = []
        for f in self.opt_frags:
            mp = nn.Parameter(self.master[f.part_offset:f.part_offset + f.length])
            mp.grad = self.reducer.grad_view(f)
            groups[L.slots[f.slot].no_decay].append(mp)
            self._opt_params.append((mp, f))
        param_groups = [{"params": groups[nd], "weight_decay": 0.0 if nd else oc.weight_decay}
                        for nd in (False, True) if groups[nd]]
        self.optimizer = torch.optim.AdamW(param_groups, lr=oc.lr,
                                           betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps)
        # Adam moments live in our flat partitions, so they are allocated once and exportable.
        for mp, f in self._opt_params:
            self.optimizer.state[mp] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": self.exp_avg[f.part_offset:f.part_offset + f.length],
                "exp_avg_sq": self.exp_avg_sq[f.part_offset:f.part_offset + f.length],
            }

    def _on_unit_ready(self, u: int) -> None:
        if self.gatherer is not None:
            self.gatherer.release(u)

    # ---- training ----------------------------------------------------------------------------
    def train(self) -> ZeroEngine:
        self.model.train()
        return self

    def eval(self) -> ZeroEngine:
        self.model.eval()
        return self

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool) -> None:
        """Backward of one micro-batch's scalar loss (already divided by the micro-batch count).

        fp16 multiplies it by the loss scale. Stage 0/1 accumulate locally and reduce during the
        last micro-batch's backward; stage 2/3 reduce-scatter during every backward.
        """
        self.reducer.begin_backward(self.stage >= 2 or is_last_micro_batch)
        if self._scale_loss:
            loss = loss.float() * self.scaler.scale
        self._in_backward = True
        try:
            loss.backward()
        finally:
            self._in_backward = False
        if self.gatherer is not None:
            self.gatherer.release_all()
        self.reducer.end_backward()
        self._grads_ready = is_last_micro_batch

    def step(self, lr: float) -> StepInfo:
        """Clip, AdamW-update the owned fp32 partition with learning rate ``lr``, refresh the
        model parameters and zero the gradients. On overflow (anywhere in the world) only the
        loss scale changes and ``skipped_steps`` grows; the caller should not advance its LR
        schedule then."""
        if not self._grads_ready:
            raise RuntimeError("step() needs a backward(..., is_last_micro_batch=True) first")
        self._grads_ready = False
        scale = self.scaler.scale if self._scale_loss else 1.0
        norm, overflow = global_grad_norm(self._norm_counted, [self.reducer.buffer],
                                          group=self.grid.world_group, ledger=self.comm)
        if self._scale_loss:
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            self.reducer.zero()
            return StepInfo(True, norm, self.scaler.scale, self._close_comm())
        norm /= scale
        coef = clip_coefficient(norm, self.opt_config.clip_grad) / scale
        if coef != 1.0:
            self.reducer.buffer.mul_(coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self._push_params()
        self.reducer.zero()
        self.optimizer_steps += 1
        return StepInfo(False, norm, self.scaler.scale, self._close_comm())

    def zero_grad(self) -> None:
        """Discard the accumulated gradients without stepping (after a NaN/inf loss)."""
        self.reducer.zero()
        self._grads_ready = False

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale if self._scale_loss else 1.0

    def _close_comm(self) -> dict:
        self.last_comm_bytes = self.comm.snapshot()
        self.comm.reset()
        return dict(self.last_comm_bytes)

    @torch.no_grad()
    def _push_params(self) -> None:
        """Copy the updated fp32 master into the compute-dtype parameters (stage 1/2 and stage-3
        persistent units: all-gather of every rank's shard)."""
        L = self.layout
        if self.stage == 0:
            self.param_flat.copy_(self.master)
            return
        if self.stage == 3:
            self.param_shard.copy_(self.master)
        for u in L.units:
            if self.stage == 3 and not u.persistent:
                continue
            buf = self.unit_bufs[u.index]
            for lo, hi in L.unit_chunks(u.index, self.ag_chunk):
                src = self.master[u.part_offset + lo:u.part_offset + hi]
                inp = self._ag_staging[:hi - lo]
                inp.copy_(src)
                out = buf if (lo, hi) == (0, u.shard) else [
                    buf[r * u.shard + lo:r * u.shard + hi] for r in range(self.dp)]
                self.comm.all_gather(out, inp).wait()

    # ---- accounting --------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: ``params`` (compute-dtype parameter storage: the full flat
        buffer, or for stage 3 the shard plus persistent units), ``grads`` (fp32 accumulation
        buffer), ``master`` (fp32 weights the optimizer updates), ``optimizer`` (Adam moments),
        ``buffers`` (communication staging, allocated once), ``gathered_peak`` (stage 3: most
        bytes of gathered units alive at once so far)."""
        def nb(t):
            return 0 if t is None else t.numel() * t.element_size()

        if self.stage < 3:
            params = nb(self.param_flat)
        else:
            params = nb(self.param_shard) + sum(
                nb(self.unit_bufs[u.index]) for u in self.layout.units if u.persistent)
        return dict(params=params, grads=nb(self.reducer.buffer), master=nb(self.master),
                    optimizer=nb(self.exp_avg) + nb(self.exp_avg_sq),
                    buffers=self.reducer.staging_bytes() + nb(self._ag_staging),
                    gathered_peak=self.gatherer.peak_bytes if self.gatherer else 0)

    def summary(self) -> str:
        """A printable account: layout, bytes held per kind, last iteration's traffic."""
        mib = {k: f"{v / 2**20:.2f} MiB" for k, v in self.memory_bytes().items()}
        traffic = {k: f"{v / 2**20:.2f} MiB" for k, v in self.last_comm_bytes.items()}
        return (f"ZeRO stage {self.stage} {self.config.precision} dp={self.dp} rank={self.dp_rank}: "
                f"{self.layout}\n  held: {mib}\n  moved last step: {traffic}")

    def comm_bytes(self) -> dict[str, float]:
        """Bytes this rank has moved per collective kind since the last ``step()`` returned
        (ring volume, see :mod:`hybrid.zero.comm`); ``step()`` hands the finished iteration's
        figures back in ``StepInfo.comm_bytes`` / ``last_comm_bytes`` and restarts the count."""
        return self.comm.snapshot()

    def reset_comm_counters(self) -> None:
        self.comm.reset()

    # ---- state export ------------------------------------------------------------------------
    @torch.no_grad()
    def _full_flat(self, domain: torch.Tensor) -> torch.Tensor:
        """All-gather a partition-shaped fp32 buffer into full flat order (collective over dp)."""
        if self.stage == 0:
            return domain
        out = torch.empty(self.layout.total_numel, dtype=domain.dtype, device=domain.device)
        for u in self.layout.units:
            self.comm.all_gather(out[u.offset:u.offset + u.padded],
                                 domain[u.part_offset:u.part_offset + u.shard].contiguous(),
                                 kind="state_all_gather").wait()
        return out

    def _by_name(self, flats: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Cut full flat buffers into ``{param name: {kind: TP-local tensor}}`` via the layout."""
        return {s.name: {k: v[s.offset:s.offset + s.numel].view(s.shape).clone() for k, v in flats.items()}
                for s in self.layout.slots}

    def optimizer_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{name: {"master", "exp_avg", "exp_avg_sq", "step"}}``: fp32 tensors with the shape of
        this TP rank's local parameter (TP-local, *not* partitioned over dp, no ZeRO padding; the
        TP padding of vocabulary rows is part of the local shape, see ``param.tp_spec``);
        ``step`` is a 0-d tensor. Collective over the data-parallel group (every rank calls)."""
        flats = {k: self._full_flat(t) for k, t in
                 (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq))}
        steps = self.optimizer_steps
        if self._opt_params:
            steps = int(self.optimizer.state[self._opt_params[0][0]]["step"].item())
        out = self._by_name(flats)
        for entry in out.values():
            entry["step"] = torch.tensor(float(steps))
        return out

    def gradients_by_name(self) -> dict[str, torch.Tensor]:
        """The reduced fp32 gradients of the finished micro-batches (call after the last
        micro-batch's backward, before :meth:`step`): ``{name: TP-local tensor}``, averaged over
        dp, loss scale still applied for fp16. Collective over dp (every rank calls)."""
        if not self._grads_ready:
            raise RuntimeError("gradients_by_name() needs a backward(..., is_last_micro_batch=True) first")
        grads = self.reducer.buffer
        if self.stage == 1:  # full-size buffer, but only this rank's shards hold the dp sum
            owned = grads.new_empty(self.layout.partition_numel)
            for u in self.layout.units:
                start = u.offset + self.grid.dp_rank * u.shard
                owned[u.part_offset:u.part_offset + u.shard] = grads[start:start + u.shard]
            grads = owned
        full = grads if self.stage == 0 else self._full_flat(grads)
        return {k: v["grad"] for k, v in self._by_name({"grad": full}).items()}

    @torch.no_grad()
    def load_optimizer_state_by_name(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`optimizer_state_by_name` (any data-parallel size produced it); also
        sets the model parameters from ``master``. Collective over dp for stages 1-3.

        Raises:
            KeyError: names missing from or unknown to ``state``.
            ValueError: a tensor's shape differs from the local parameter's.
        """
        names = {s.name for s in self.layout.slots}
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise KeyError(f"optimizer state mismatch: missing {missing}, unexpected {unexpected}")
        for s in self.layout.slots:
            for k in ("master", "exp_avg", "exp_avg_sq"):
                if tuple(state[s.name][k].shape) != s.shape:
                    raise ValueError(f"{s.name}.{k}: shape {tuple(state[s.name][k].shape)}, "
                                     f"expected {s.shape}")
        bufs = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        for mp, f in self._opt_params:
            entry = state[self.layout.slots[f.slot].name]
            for k, buf in bufs.items():
                src = entry[k].reshape(-1)[f.param_start:f.param_start + f.length]
                buf[f.part_offset:f.part_offset + f.length].copy_(src)
            self.optimizer.state[mp]["step"].fill_(float(entry["step"]))
        self.optimizer_steps = int(next(iter(state.values()))["step"])
        self._push_params()

    def model_state_dict_full(self) -> dict[str, torch.Tensor]:
        """The full single-process fp32 state dict (from the master weights), identical on every
        rank. Collective over dp and tp (every rank calls)."""
        flat = self._full_flat(self.master)
        out = {}
        for s in self.layout.slots:
            local = flat[s.offset:s.offset + s.numel].view(s.shape)
            out[s.name] = gather_full_tensor(local, get_tp_spec(self.params[s.index]),
                                             self.grid.tp_group)
        return out
