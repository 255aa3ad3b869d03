"""The ZeRO engine: data parallelism with partitioned model states (ZeRO paper, §5) over the
data-parallel group of a :class:`hybrid.parallel.grid.ProcessGrid`, on each TP rank's own shard.

Usage (one optimizer step of ``m`` micro-batches)::

    engine = ZeroEngine(model, grid, ZeroConfig(stage=2, precision="bf16"),
                        OptimizerConfig(lr=3e-4))
    for i, (tokens, labels) in enumerate(micro_batches):
        loss = engine.model(tokens, labels).mean() / m
        engine.backward(loss, is_last_micro_batch=(i == m - 1))
    info = engine.step(lr)          # info.skipped, info.grad_norm, info.loss_scale

Pieces (one concept per file): :mod:`hybrid.zero.stage` (what the stage partitions, decided
once), :mod:`hybrid.zero.layout` (the one partition layout), :mod:`hybrid.zero.storage` (the
flat buffers), :mod:`hybrid.zero.reduce` (fp32 accumulation and bucketed gradient reduction),
:mod:`hybrid.zero.refresh` (the master back into the parameters), :mod:`hybrid.zero.stage3`
(parameter gathering), :mod:`hybrid.zero.state` (state export), :mod:`hybrid.zero.grad_norm`
(the one norm), :mod:`hybrid.zero.loss_scaler`, :mod:`hybrid.zero.comm` (collectives with a
byte ledger), :mod:`hybrid.zero.adamw` (the optimizer), :mod:`hybrid.zero.offload`
(``--optimizer-cpu-offload``: the table's master and optimizer columns in host memory). Only
this file reads the engine's private attributes; the others take explicit arguments or the
engine's public views (``states``, ``plan``, ``opt_params``).

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

The paper (§3.1, §5) counts 2 bytes of gradient; we keep fp32 gradients (4 bytes: micro-batches
accumulate in fp32), or bf16 ones with ``grad_reduce_in_bf16``. In fp32 training ``params`` is 4
bytes per element and the fp32 master a separate copy: 20 Psi at stage 0, not 16. Stage 3 keeps
persistent (small) parameters whole, and gathers units transiently (``gathered_peak``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from hybrid.zero import accounting, adamw, hpz, refresh, state, storage
from hybrid.zero.comm import DPComm
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from hybrid.zero.grad_norm import clip_coefficient, global_grad_norm_and_stop
from hybrid.zero.layout import Fragment, PartitionLayout
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.offload import HostGrads, host_split
from hybrid.zero.profile import NULL_TIMER
from hybrid.zero.qgz import quantized_reduce_scatter
from hybrid.zero.reduce import GradReducer
from hybrid.zero.stage3 import ParamGatherer

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid

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
    """Bytes this rank moved per collective kind this iteration (``DPComm``'s ledger)."""
    node_bytes: dict = field(default_factory=dict)
    """The same, split ``{"intra_node": {kind: bytes}, "inter_node": {kind: bytes}}``."""


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
            ``hybrid.parallel.tp_weights.seeded_weights(config, seed)``; None reads the model's own
            (materialised) parameters.

    Raises:
        ValueError: a meta parameter without ``weights``, a meta buffer, a wrong source shape.
    """

    timer = NULL_TIMER  # the per-phase profiler (set_profiler); a no-op by default

    def __init__(self, model: nn.Module, grid: ProcessGrid, zero_config: ZeroConfig,
                 optimizer_config: OptimizerConfig, weights: storage.WeightSource | None = None):
        self.model, self.grid = model, grid
        self.config, self.opt_config = zero_config, optimizer_config
        self.plan = zero_config.plan
        """What the stage partitions and how it reduces (:mod:`hybrid.zero.stage`)."""
        self.stage, self.dtype = self.plan.stage, zero_config.dtype
        self.comm = DPComm(grid.dp_group, quantized=quantized_reduce_scatter(grid, zero_config))
        self.dp, self.dp_rank = self.comm.size, self.comm.rank
        self.params = [p for _, p in model.named_parameters()]
        self.layout = L = PartitionLayout.from_model(
            model, self.dp, self.plan.persistence_threshold, ALIGN)
        self.own = L.fragments(self.dp_rank)
        self._in_backward = False
        self._grads_ready = False
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self.stop_source: Callable[[], bool] | None = None
        """This rank's stop request (SIGTERM, time limit), carried by the grad-norm all-reduce."""
        self._stop_seen: bool | None = None
        self.last_comm_bytes: dict = {}
        self.activation_checkpointing = None
        """Set by ``hybrid.parallelize.parallelize``: the checkpointing handle, or None."""
        self.host_split = host_split(L, zero_config.offload_fraction)
        """Elements of the partition whose optimizer lives in host memory (``[0, host_split)``,
        :mod:`hybrid.zero.offload`; 0 without ``--optimizer-cpu-offload``)."""
        self._build_buffers(weights)
        self.reducer = GradReducer(
            self.params, L, self.plan, self.comm, zero_config.reduce_bucket_size,
            zero_config.overlap_comm, on_unit_ready=self._on_unit_ready,
            grad_dtype=zero_config.grad_dtype, fusion=zero_config.gradient_accumulation_fusion)
        self.host_grads = (HostGrads(L, self.host_split, zero_config.grad_dtype,
                                     self.reducer.owned_grad) if self.host_split else None)
        self.reducer.on_unit_reduced = self.host_grads and self.host_grads.unit_reduced
        self.gatherer = None
        if self.plan.shards_parameters:
            self.gatherer = ParamGatherer(
                model, L, self.states.unit_bufs, self.states.param_shard, self.comm, self.ag_chunk,
                lambda: self._in_backward, hpz.secondary_partition(grid, L, self.comm, zero_config),
                zero_config.quantized_weights)
        self.deferred = (refresh.DeferredGathers(model, L) if zero_config.overlap_param_gather
                         else None)  # --overlap-param-gather: gathers in flight since the step
        self._build_optimizer()
        self._build_norm_views()
        self._build_scaler()

    # ---- construction ------------------------------------------------------------------------
    @torch.no_grad()
    def _build_buffers(self, weights: storage.WeightSource | None) -> None:
        """Steady-state buffers, filled unit by unit (:mod:`hybrid.zero.storage`): the
        construction peak is the model states plus one unit in fp32, never a second full copy."""
        L, dev = self.layout, self.grid.device
        storage.check_materialised(self.model)
        self.states = storage.allocate_states(L, self.plan, self.dtype, dev, self.host_split)
        """The flat buffers this rank holds (:class:`hybrid.zero.storage.FlatStates`)."""
        storage.fill_units(self.states, L, self.plan, self.dp_rank, self.params,
                           weights or storage.model_weights(self.params))
        self.params = storage.bind_parameters(self.model, L, self.params, self.states.unit_bufs)
        self.ag_chunk = max(1, self.config.allgather_bucket_size // self.dp)
        self.ag_staging = (torch.empty(min(self.ag_chunk, L.partition_numel), dtype=self.dtype,
                                        device=dev) if self.plan.shards_optimizer_states else None)

    def load_weights(self, weights: storage.WeightSource, units=None) -> None:
        """Set the fp32 master and the compute-dtype parameters from ``weights`` one unit at a
        time, without collectives (``units``: indices into ``layout.units``, default all); the
        Adam moments are unchanged. ``--finetune`` weights enter this way, like initial ones.

        Raises:
            ValueError: a source tensor's shape differs from the local parameter's.
        """
        self.wait_param_gather()
        storage.fill_units(self.states, self.layout, self.plan, self.dp_rank, self.params,
                           weights, units)

    def _build_optimizer(self) -> None:
        frags = self.own if self.plan.shards_optimizer_states else self.layout.whole_fragments()
        self.optimizer, self.opt_params = adamw.build_adamw(
            self.layout, frags, self.states, self.opt_config,
            self._grad_of if self.reducer.grad_dtype == torch.float32 else None,
            self.grid.device, self.host_split, self.config.optimizer_cpu_threads)
        # opt_params: [(1-D view of states.master, its fragment)] (hybrid.zero.adamw)

    def _grad_of(self, f: Fragment) -> torch.Tensor:
        """Fragment ``f``'s reduced gradient: its host copy if offloaded, else the device's."""
        if f.part_offset < self.host_split:
            return self.host_grads.buf[f.part_offset:f.part_offset + f.length]
        return self.reducer.grad_view(f)

    def _build_norm_views(self) -> None:
        L, tp_rank = self.layout, self.grid.tp_rank
        counted = [f for f in self.own if not L.slots[f.slot].tp_replicated or tp_rank == 0]
        self._norm_counted = [self.reducer.grad_view(f) for f in counted]
        # Overflow check of the rest of what this rank owns: an inf/NaN anywhere reaches an
        # owner (the reduction sums it into the owner's slice; stage 0 all-reduces everywhere).
        self._norm_uncounted = [self.reducer.grad_view(f) for f in self.own
                                if L.slots[f.slot].tp_replicated and tp_rank != 0]

    def _build_scaler(self) -> None:
        zc = self.config
        fp16 = zc.precision == "fp16"
        self.scaler = LossScaler(
            zc.loss_scale if zc.loss_scale is not None
            else (zc.initial_loss_scale if fp16 else 1.0),
            dynamic=fp16 and zc.loss_scale is None, window=zc.loss_scale_window,
            hysteresis=zc.hysteresis, min_scale=zc.min_loss_scale)
        self._scale_loss = fp16

    def _on_unit_ready(self, u: int) -> None:
        if self.gatherer is not None:
            self.gatherer.release(u)

    def set_profiler(self, timer=None) -> None:
        """Time the phases of every step with ``timer`` (a :class:`hybrid.zero.profile.PhaseTimer`;
        None switches profiling off). The caller times its forward as ``timer.phase("forward")``."""
        timer = NULL_TIMER if timer is None else timer
        self.timer = self.reducer.timer = timer
        for g in (g for g in (self.deferred, self.gatherer) if g is not None):
            g.timer = timer

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
        self.wait_param_gather()  # a unit the forward did not reach
        with self.timer.phase("backward"):
            self.reducer.begin_backward(self.plan.reduce_every_micro_batch or is_last_micro_batch,
                                        last=is_last_micro_batch)
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

    def step(self, lr: float, weight_decay: float | None = None,
             decoupled_lr: float | None = None) -> StepInfo:
        """Clip, AdamW-update the owned fp32 partition with learning rate ``lr`` (``decoupled_lr``
        for the embedding and output weights, Megatron-LM's ``--decoupled-lr``; None: ``lr``) and
        ``weight_decay`` for the decayed parameters (None: unchanged), refresh the
        model parameters and zero the gradients. On overflow (anywhere in the world) only the
        loss scale changes and ``skipped_steps`` grows; the caller should not advance its LR
        schedule then."""
        if not self._grads_ready:
            raise RuntimeError("step() needs a backward(..., is_last_micro_batch=True) first")
        self.wait_param_gather()
        self._grads_ready = False
        scale = self.scaler.scale if self._scale_loss else 1.0
        with self.timer.phase("grad_norm"):
            norm, overflow, stop = global_grad_norm_and_stop(
                self._norm_counted, self._norm_uncounted, group=self.grid.world_group,
                ledger=self.comm, stop=self.stop_source is not None and self.stop_source())
        self._stop_seen = stop
        if self.host_grads is not None:
            with self.timer.phase("d2h_wait"):
                self.host_grads.wait()  # before the host step, and before zeroing the source
        if self._scale_loss:
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            with self.timer.phase("zeroing"):
                self.reducer.zero()
            return StepInfo(True, norm, self.loss_scale, *self._close_comm())
        norm /= scale
        coef = clip_coefficient(norm, self.opt_config.clip_grad) / scale
        with self.timer.phase("optimizer"):
            self._optimizer_grads(coef)
            for g in self.optimizer.param_groups:
                g["lr"] = decoupled_lr if g["decoupled"] and decoupled_lr is not None else lr
                if weight_decay is not None:
                    g["weight_decay"] = weight_decay * g["wd_mult"]
            if self.host_grads is None:
                self.optimizer.step()
            else:
                self.optimizer.step_device()
                with self.timer.phase("host_step"):
                    self.optimizer.step_host()
            if self.reducer.grad_dtype != torch.float32:
                for mp, _ in self.opt_params:
                    mp.grad = None  # the fp32 copies live for the step only
        with self.timer.phase("refresh"):
            self.refresh_params()
        with self.timer.phase("zeroing"):
            self.reducer.zero()
        self.optimizer_steps += 1
        return StepInfo(False, norm, self.loss_scale, *self._close_comm())

    def _optimizer_grads(self, coef: float) -> None:
        """Clip (and unscale) only the fragments AdamW steps (1/dp at stages 1-3, one multi-tensor
        multiply); bf16 gradients become fp32 copies for the step (as Megatron-LM's optimizer)."""
        if self.reducer.grad_dtype != torch.float32:
            for mp, f in self.opt_params:
                mp.grad = self._grad_of(f).float()
        if coef != 1.0:
            by_device: dict[torch.device, list] = {}
            for mp, _ in self.opt_params:
                by_device.setdefault(mp.grad.device, []).append(mp.grad)
            for grads in by_device.values():
                torch._foreach_mul_(grads, coef)

    def take_stop_request(self) -> bool | None:
        """Whether any rank asked to stop, as the last :meth:`step`'s grad-norm all-reduce
        carried it (``stop_source``); None when no step ran since the last call."""
        seen, self._stop_seen = self._stop_seen, None
        return seen

    def zero_grad(self) -> None:
        """Discard the accumulated gradients without stepping (after a NaN/inf loss)."""
        self.reducer.zero()
        self._grads_ready = False

    def close(self) -> None:
        """Remove the gradient and stage-3 hooks. They close reference cycles through autograd
        (parameter -> hook -> engine -> process groups) that Python's collector cannot see, so
        without this the process groups (and gloo's threads) outlive ``destroy_process_group``."""
        self.wait_param_gather()
        for h in [*self.reducer.hooks, *(g for g in (self.gatherer, self.deferred) if g)]:
            h.remove()

    def refresh_params(self) -> None:
        """Copy the fp32 master into the compute-dtype parameters (collective over dp at stages
        1-3; :func:`hybrid.zero.refresh.refresh_params`)."""
        self.wait_param_gather()
        refresh.refresh_params(self.states, self.layout, self.plan, self.comm, self.ag_chunk,
                               self.ag_staging, self.deferred)

    def wait_param_gather(self) -> None:
        """Wait for the parameter all-gathers ``--overlap-param-gather`` left in flight (the
        forward waits unit by unit; anything else reading the parameters calls this first)."""
        if self.deferred is not None:
            self.deferred.wait_all()

    @property
    def grads_ready(self) -> bool:
        """A ``backward(..., is_last_micro_batch=True)`` has run and ``step`` has not yet."""
        return self._grads_ready

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale if self._scale_loss else 1.0

    def _close_comm(self) -> tuple[dict, dict]:
        self.last_comm_bytes, nodes = self.comm.snapshot(), self.comm.node_snapshot()
        self.comm.reset()
        return dict(self.last_comm_bytes), nodes

    # ---- accounting (implemented in hybrid.zero.accounting) --------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """See :func:`hybrid.zero.accounting.memory_bytes`."""
        return accounting.memory_bytes(self)

    def held_tensors(self) -> list[torch.Tensor]:
        """See :func:`hybrid.zero.accounting.held_tensors`."""
        return accounting.held_tensors(self)

    def summary(self) -> str:
        """See :func:`hybrid.zero.accounting.summary`."""
        return accounting.summary(self)

    # ---- state export (implemented in hybrid.zero.state) ------------------------------------
    def optimizer_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """See :func:`hybrid.zero.state.optimizer_state_by_name` (all-gather; not for
        checkpoints)."""
        return state.optimizer_state_by_name(self)

    def load_optimizer_state_by_name(self, by_name: dict[str, dict[str, torch.Tensor]]) -> None:
        """See :func:`hybrid.zero.state.load_optimizer_state_by_name`."""
        state.load_optimizer_state_by_name(self, by_name)

    def gradients_by_name(self) -> dict[str, torch.Tensor]:
        """See :func:`hybrid.zero.state.gradients_by_name`."""
        return state.gradients_by_name(self)

    def model_state_dict_full(self) -> dict[str, torch.Tensor]:
        """See :func:`hybrid.zero.state.model_state_dict_full`."""
        return state.model_state_dict_full(self)
