"""ZeRO-Offload in the planner: the optimizer's share of a rank's partition on the host.

Megatron-LM's ``--optimizer-cpu-offload`` with ``--optimizer-offload-fraction F`` (its hybrid
device optimizer) and DeepSpeed's ``offload_optimizer``, after the ZeRO-Offload paper (Ren et
al., arXiv 2101.06840). Every count is per rank unless it says per node.

Bytes (ZeRO-Offload §3, "the unique optimal offload strategy": the fp32 states and the
optimizer step go to the host, the 16-bit parameters and the forward/backward stay on the GPU).
Of a rank's optimizer partition of ``P`` elements (ZeRO 1910.02054 §5.1: ``ceil(Psi_t / dp)``
at stages 1-3), ``P_off = round(F * P)`` go to the host:

    host bytes   = P_off * (master + Adam + grad)  (engine bf16: 4 + 8 + 4 = 16 B/element;
                   ``grad`` is the host copy of the reduced gradient partition, 2 B with
                   ``--grad-reduce-in-bf16``)
    device bytes = the same model states less P_off * (master + Adam) (the 16-bit parameters
                   and the gradient buffers stay: backward still reduces on the GPU)

The node's ranks all hold theirs, so ``host per node = gpus_per_node * (host bytes + P_a+cpu
checkpoints)``, checked against ``Cluster.host_memory_bytes`` (``--host-memory-gib``).

Seconds (the schedule of ZeRO-Offload §4.1-4.2 at ZeRO stages 1-3: each rank moves only its
partition; without the one-step delayed parameter update of §5.2, so the step stays exact):

- gradient copy, device -> host: ``P_off * grad_bytes / cpu_gbs``, per bucket as soon as its
  last reduce-scatter ends, on a side stream during the last micro-batch's backward (Megatron's
  ``--overlap-cpu-optimizer-d2h-h2d``). Exposed: the share of the units reduced when backward
  ends (root, block 0, persistent parameters: ``tail``) and whatever of the rest the last
  backward's GEMMs do not cover.
- host AdamW (AdamW 1711.05101 Alg. 2; bandwidth bound, as the CPU-Adam of ZeRO-Offload §5.1
  is vectorised past its arithmetic): per element it reads and writes the fp32 master and both
  moments (``2k`` = 24 B), reads the gradient, writes the 16-bit parameter and the copy engine
  reads that again: ``2k + grad + 2 param`` = 32 B (bf16 engine). The node's ranks step at once
  and share the DRAM: ``gpus_per_node * P_off * 32 / (host_memory_gbs * host_efficiency)``. It
  starts after backward: the gradient norm (clipping, the loss scaler's overflow check) needs
  every gradient first. ``host_memory_gbs`` is the DDR peak (``hybrid.devices``);
  ``host_efficiency`` (0.5) is an assumption, below what STREAM-class kernels sustain on
  two-socket servers, to be replaced by a measurement: ``scripts/bench_host_adam.py`` finds
  torch's fused CPU AdamW (``fused=True``) at 87-134% of a triad's bandwidth on the same
  threads, i.e. bandwidth bound as modelled, and its foreach and for-loop forms 4-50x slower
  (three runs on a busy 2-core machine): the model holds for the fused one only.
- parameter copy, host -> device: ``P_off * param_bytes / cpu_gbs``, per unit as the host
  finishes it, so the host step and this copy pipeline over the ``N + 1`` units:
  ``max(adam, h2d) + min(adam, h2d) / (N + 1)``.
- the device AdamW on the kept ``(1 - F)`` share runs at the same time (its kernels are
  queued before the host starts), so the optimizer's exposed time is the longer of the two.
- not overlapped (said so): the refresh all-gather of stages 1-2 waits for the parameters to
  come back; the copies' host-side page faults (memory is pinned); PCIe shared between two
  GPUs behind one switch. The gradient copy (device -> host) and P_a+cpu's backward loads
  (host -> device) use the link's two directions.
"""

from __future__ import annotations

from hybrid.planner.inputs import GB

OFFLOAD_SEARCH = (0.0, 0.5, 1.0)
"""Fractions the planner tries by default: the optimizer on the device, half or all of it on
the host (half halves the host step where it is what is exposed, e.g. a 40B GPT on 8 H100)."""


def offloaded_elements(partition: int, fraction: float) -> int:
    """Elements of a rank's optimizer partition of ``partition`` elements whose optimizer runs on
    the host: ``round(fraction * partition)`` (Megatron-LM splits by element count; ``fraction``
    as ``ZeroConfig`` validates it, in [0, 1])."""
    return round(fraction * partition)


def split_states(states: dict, partition: int, fraction: float, prec) -> tuple[dict, dict]:
    """``(device, host)`` model-state bytes of one rank (module docstring).

    ``states``: :func:`hybrid.planner.memory.model_state_bytes` of the layout (its master and
    Adam states sharded, i.e. stage 1-3), ``partition`` its owned elements, ``prec`` its
    :class:`hybrid.planner.precision.Precision`. ``device`` has ``states``'s keys, ``host`` is
    ``{'master', 'optimizer', 'grads', 'total'}``, bytes.
    """
    off = offloaded_elements(partition, fraction)
    host = {"master": off * prec.master_bytes, "optimizer": off * prec.optimizer_bytes,
            "grads": off * prec.grad_bytes}
    host["total"] = sum(host.values())
    device = dict(states, master=states["master"] - host["master"],
                  optimizer=states["optimizer"] - host["optimizer"])
    device["total"] = sum(device[k] for k in ("params", "grads", "master", "optimizer"))
    return device, host


def host_bytes(host_states: dict, cpu_checkpoints: int, ranks_per_node: int) -> dict:
    """What one rank and one node keep in host memory, bytes: ``{'states'`` (offloaded
    optimizer, :func:`split_states`), ``'checkpoints'`` (P_a+cpu), ``'rank'``, ``'node'``
    (``ranks_per_node`` ranks)``}``."""
    rank = host_states["total"] + cpu_checkpoints
    return {"states": host_states["total"], "checkpoints": cpu_checkpoints, "rank": rank,
            "node": rank * ranks_per_node}


def host_adam_bytes_per_element(prec) -> int:
    """Host DRAM bytes the offloaded AdamW touches per element (module docstring):
    ``2k + grad_bytes + 2 param_bytes`` (32 in the engine's bf16)."""
    return 2 * prec.k + prec.grad_bytes + 2 * prec.param_bytes


def offload_seconds(offloaded: int, prec, cluster, backward_s: float, tail_share: float,
                    units: int) -> dict:
    """Seconds of one step's offloaded optimizer for ``offloaded`` elements of this rank
    (module docstring): totals ``d2h_s``, ``h2d_s``, ``host_adam_s``; ``host_step_s`` (the host
    step and the parameters' copy back, pipelined over ``units``) and ``d2h_exposed_s`` (the
    gradient copy beyond ``backward_s``, the last micro-batch's backward GEMMs; ``tail_share``
    of it is reduced only when backward ends). ``cluster``: a ``planner.inputs.Cluster``."""
    link = cluster.cpu_gbs * GB
    d2h = offloaded * prec.grad_bytes / link
    h2d = offloaded * prec.param_bytes / link
    dram = cluster.host_memory_gbs * cluster.host_efficiency * GB
    adam = cluster.gpus_per_node * offloaded * host_adam_bytes_per_element(prec) / dram
    exposed = d2h * tail_share + max(0.0, d2h * (1 - tail_share) - backward_s)
    host_step = max(adam, h2d) + min(adam, h2d) / units if offloaded else 0.0
    return {"d2h_s": d2h, "h2d_s": h2d, "host_adam_s": adam, "host_step_s": host_step,
            "d2h_exposed_s": exposed}
