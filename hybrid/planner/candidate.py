"""One evaluated layout of the planner (:func:`hybrid.planner.plan.evaluate`): its per-rank
bytes on the device and the host, traffic and step seconds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout; all byte counts are per rank, times per optimizer step."""

    tp: int
    dp: int
    stage: int
    activation: str
    micro_batches: int
    """Gradient-accumulation steps: global batch / (micro batch * dp)."""
    micro_batch_size: int
    """Sequences per rank per micro-batch b (searched by ``plan(..., micro_batch_sizes=...)``)."""
    params_per_rank: int
    """Parameters of this rank's TP shard (elements), before ZeRO."""
    model_states: dict
    """{'params', 'grads', 'master', 'optimizer', 'total'} bytes on the device (less what
    ZeRO-Offload keeps on the host: ``host_bytes``)."""
    activations: dict
    """``memory_estimate.activation_bytes`` of one micro-batch."""
    buffers: int
    """Constant-size communication buffers (and stage 3's gathered units at their peak), bytes:
    ``memory.comm_buffer_bytes``, the engine's ``buffers`` (+ ``gathered_peak``)."""
    total_bytes: int
    """model states + GPU activations + temporaries + buffers + reserved, bytes."""
    fits: bool
    """Both limits hold: ``total_bytes`` <= GPU memory and ``host_bytes['node']`` <= host
    memory per node (``device_fits``, ``host_fits``)."""
    dp_bytes: float
    """Data-parallel bytes sent per step by this rank."""
    tp_bytes: float
    """Tensor-parallel bytes sent per step by this rank."""
    cpu_bytes: float
    """Bytes moved to and from the host per step (P_a+cpu)."""
    times: dict = field(default_factory=dict)
    """Seconds per step: ``compute_s`` (GEMMs), ``tp_s`` / ``dp_s`` / ``cpu_s`` (each kind's
    bytes / bandwidth, hidden or not), ``step_s`` (the overlapped step) = ``compute_s`` +
    ``exposed_s``, whose parts are ``tp_exposed_s``, ``first_gather_s``, ``last_reduce_s``,
    ``unhidden_dp_s``, ``refresh_s``, ``optimizer_s``, ``cpu_exposed_s``,
    ``offload_exposed_s`` (``step_time.step_seconds``, ``step_time.with_offload``);
    ``dp_exposed_s`` sums the data-parallel ones, ``tp_hidden_s`` is what SP's backward hides;
    ZeRO-Offload's totals: ``device_optimizer_s``, ``host_step_s``, ``host_adam_s``,
    ``offload_d2h_s``, ``offload_h2d_s`` (:mod:`hybrid.planner.offload`)."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    dp_bytes_by_kind: dict = field(default_factory=dict)
    """``dp_bytes`` split into {'all_reduce', 'reduce_scatter', 'all_gather'} (``zero_comm``
    names)."""
    persistent_params: int = 0
    """Stage 3: elements of the TP shard kept whole (``Training.param_persistence_threshold``)."""
    temporaries: dict = field(default_factory=dict)
    """``temporaries.temporary_bytes``: the step's short-lived bytes beyond the activations."""
    offload_fraction: float = 0.0
    """Share of the rank's optimizer partition stepped on the host (Megatron-LM's
    ``--optimizer-offload-fraction`` with ``--optimizer-cpu-offload``; 0: none)."""
    host_bytes: dict = field(default_factory=dict)
    """Host memory, bytes (``offload.host_bytes``): ``{'states'`` (fp32 master, Adam and the
    gradient copy of the offloaded share), ``'checkpoints'`` (P_a+cpu), ``'rank'``, ``'node'``
    (every rank of a node)``}``."""
    offload_bytes: float = 0.0
    """Bytes moved between this rank's GPU and the host per step by the offloaded optimizer
    (gradients down, 16-bit parameters up)."""
    device_fits: bool = True
    """``total_bytes`` <= GPU memory."""
    host_fits: bool = True
    """``host_bytes['node']`` <= the cluster's host memory per node."""
    inter_node_dp_bytes: float = 0.0
    """Of ``dp_bytes``, those that cross nodes (``zeropp.inter_node_bytes``)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
