"""Memory planner: which (TP degree, ZeRO stage, activation option) fits a cluster, and which is
fastest.

For every candidate tensor-parallel degree t (a power of two dividing the heads, the GPU count and
<= GPUs per node; dp = GPUs / t), ZeRO stage 0-3 and activation option
(none / full checkpointing / + P_a / + P_a+cpu) it computes per-rank bytes (model states, one
micro-batch of activations, constant-size communication buffers), whether that fits, the DP and
TP traffic per step and an estimated step time. ``python -m hybrid.planner.plan --help`` for the
CLI.

Cost model (every term is printed so it can be argued with):
    step_s = compute_s + the exposed seconds of :mod:`hybrid.planner.step_time`: per block
        the longer of its compute and the collectives the engine overlaps with it, plus the
        tensor-parallel collectives on the critical path, the first gather, the last reduce,
        the parameter refresh, the optimizer and P_a+cpu's unhidden copies.
    compute_s = hardware FLOPs per step / (GPUs * peak * efficiency); hardware FLOPs are
        2205.05198 Eq. 7 without checkpointing and 2104.04473 Eq. 3 (one extra forward) with it,
        so the recompute penalty is the 4/3 factor on the layers.
    tp_s = TP bytes per rank per step / intra-node bandwidth (TP groups never leave a node).
    dp_s = DP bytes per rank per step / inter-node bandwidth per GPU when the job spans nodes,
        else / intra-node bandwidth.
    cpu_s = 2 * partitioned checkpoint bytes per micro-batch * micro-batches / host-link bandwidth
        (P_a+cpu: out in forward, back in backward, ZeRO §8).
    tp_s, dp_s and cpu_s are totals, hidden or not; the step counts only what is exposed.
The micro-batch size is the training's, or searched (``plan(..., search_micro_batch=True)``).
Bandwidths are achieved per-GPU bus bandwidths in GB/s (1e9 B/s). Defaults describe a DGX A100:
NVLink ~200 GB/s achievable all-reduce bus bandwidth, one 200 Gb/s HDR NIC per GPU = 25 GB/s,
PCIe 4 x16 ~20 GB/s, 45% of peak on the GEMMs (2104.04473 Table 1 reaches 44-52%).
Model states follow ``Training.accounting``: 'paper' (ZeRO §3.1, 16 B/param mixed precision,
which reproduces the paper's tables) or 'engine' (``hybrid.zero.engine.ZeroEngine``'s allocations:
fp32 gradient accumulation, separate fp32 master; 18 B/param in bf16; ``hybrid.plan``'s default).
Data-parallel traffic follows the engine's schedule (``traffic.dp_traffic_by_kind``) in both.
The fastest fitting candidate wins; ties go to the lower ZeRO stage, then the smaller footprint.
"Fits" means model states + activations + temporaries + buffers + ``reserved_bytes`` (default
1 GiB for the CUDA context and fragmentation; pass 0 to reproduce the ZeRO tables) <= GPU memory,
the dry run's rule too (:func:`hybrid.devices.fit_verdict`); bytes here, GiB in the CLI.

Constant-size buffers (ZeRO §6.2, C_B): gradients are reduced in buckets of 5e7 elements and
stage 3 gathers parameters in buckets of 5e7 elements (100 MB each in bf16, two of each in flight).
DeepSpeed's 5e8 defaults cost 2 GB per bucket pair; 5e7 keeps collectives large enough to reach
bus bandwidth (>= 100 MB messages) at a twentieth of the memory.
"""

from __future__ import annotations

import dataclasses
import itertools

from hybrid.flops import flops_per_iteration, layer_parameter_split
from hybrid.parallel.sequence import sequence_parallel_active
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.parallel.vocab import pad_vocab_size
from hybrid.planner import zeropp
from hybrid.planner.candidate import Candidate
from hybrid.planner.inputs import GB, Cluster, Training, layout_zero
from hybrid.planner.memory import (
    ACTIVATION_OPTIONS,
    ZERO_STAGES,
    activation_bytes,
    comm_buffer_bytes,
    model_state_bytes,
    params_per_tp_rank,
    persistent_parameters,
)
from hybrid.planner.offload import OFFLOAD_SEARCH, host_bytes, offloaded_elements, split_states
from hybrid.planner.precision import ACCOUNTINGS, get_precision
from hybrid.planner.step_time import qgz_intra_bytes, qgz_setting, step_breakdown
from hybrid.planner.temporaries import embedding_backward_bytes, temporary_bytes
from hybrid.planner.tp_choices import check_tp, tp_candidates
from hybrid.planner.traffic import dp_traffic_bytes, tp_traffic_elements
from models.config import GPTConfig

__all__ = [
    "ACCOUNTINGS",
    "Cluster",
    "Training",
    "Candidate",
    "tp_candidates",
    "evaluate",
    "plan",
    "micro_batch_choices",
    "best",
    "model_state_bytes",
    "dp_traffic_bytes",
    "activation_bytes",
]

EXPOSED_DP = ("first_gather_s", "last_reduce_s", "unhidden_dp_s", "refresh_s")
"""The data-parallel parts of a step's exposed seconds (``Candidate.times``)."""


def _padded(model: GPTConfig, tp: int, training: Training) -> GPTConfig:
    m = model
    vocab = pad_vocab_size(m.vocab_size, tp, training.make_vocab_size_divisible_by)
    return dataclasses.replace(m, vocab_size=vocab)


def _check_layout(model: GPTConfig, cluster: Cluster, training: Training, tp: int,
                  activation: str, zero: tuple[int, float]) -> tuple[GPTConfig, Training]:
    """The model with its vocabulary padded for ``tp`` and ``training`` with the layout's
    ZeroConfig (``zero``: stage and offload fraction, :func:`hybrid.planner.inputs.layout_zero`),
    after checking the layout is possible.

    Raises ValueError: tp does not divide the heads, the MLP width or the GPUs, or sequence
    parallelism with tp not dividing the sequence length; ConfigError (a ValueError): what
    ZeroConfig refuses of the layout (offload at stage 0, a fraction outside [0, 1]).
    """
    m0 = model
    check_tp(m0, tp, cluster)
    m = _padded(m0, tp, training)
    s = training.seq_length
    if (sequence_parallel_active("sp" in activation.split("+"), tp)
            and tp_split_refusal(m0, tp, sequence_length=s) is not None):
        raise ValueError(f"sequence parallelism needs seq_length divisible by tp: "
                         f"{s} % {tp} = {s % tp}")
    return m, dataclasses.replace(training, zero=layout_zero(training.zero, *zero))


def _precision(training: Training):
    """Bytes per element of ``training``'s precision and accounting
    (:class:`hybrid.planner.precision.Precision`); bf16 gradients (``--grad-reduce-in-bf16``)
    are held, accumulated and reduced in 2 bytes."""
    prec = get_precision(training.zero.precision, training.accounting)
    return dataclasses.replace(prec, grad_bytes=2) if training.zero.grad_reduce_in_bf16 else prec


def _batch(training: Training, cluster: Cluster, dp: int) -> tuple[int, int]:
    """``(global batch, micro-batches per rank per step)``; ValueError when they do not divide."""
    b = training.micro_batch_size
    gbs = training.global_batch_size or b * cluster.num_gpus
    if gbs % (b * dp):
        raise ValueError(
            f"global_batch_size={gbs} is not a multiple of micro_batch_size * dp = {b} * {dp}"
        )
    return gbs, gbs // (b * dp)


def _buffer_bytes(m: GPTConfig, tp: int, dp: int, stage: int, prec, psi_t: int,
                  training: Training) -> int:
    """Communication buffers of one rank (``memory.comm_buffer_bytes``), bytes: one block's
    local parameters bound stage 3's gather unit, the rest is the root unit."""
    layer_sharded, layer_replicated = layer_parameter_split(m)
    block = layer_sharded // tp + layer_replicated
    root = psi_t - m.num_layers * block
    return comm_buffer_bytes(psi_t, stage, training.zero.reduce_bucket_size,
                             training.zero.allgather_bucket_size, prec, block, dp,
                             training.zero.overlap_comm, root,
                             unit_in_place=training.zero.gradient_accumulation_fusion
                             and training.zero.grad_reduce == "reduce_scatter")


def _traffic(m: GPTConfig, tp: int, dp: int, stage: int, prec, micro_batches: int,
             persistent: int, activation: str, training: Training, acts: dict,
             gpus_per_node: int) -> tuple[dict, float, float]:
    """``(dp bytes by kind, tp bytes, host bytes)`` one rank moves per optimizer step (qgZ's
    reduce-scatter bytes depend on the ranks per node)."""
    parts = set(activation.split("+"))
    s, b = training.seq_length, training.micro_batch_size
    dp_kinds = dp_traffic_bytes(
        m, dp, stage, tp, prec, micro_batches, persistent_params=persistent, by_kind=True,
        grad_reduce=training.zero.grad_reduce, qgz=qgz_setting(training, gpus_per_node, tp, dp),
    )
    tp_elems = tp_traffic_elements(b, s, m.hidden_size, tp, m.num_layers, "full" in parts,
                                   "pa" in parts, m.vocab_size, sequence_parallel="sp" in parts)
    tp_bytes = tp_elems * prec.activation_bytes * micro_batches
    cpu_bytes = 2 * acts["cpu"] * micro_batches
    return dp_kinds, tp_bytes, cpu_bytes


def _step_times(m: GPTConfig, cluster: Cluster, training: Training, gbs: int, tp: int, dp: int,
                stage: int, activation: str, prec, threshold: int, micro_batches: int,
                traffic: tuple[float, float, float, float],
                offloaded: int = 0) -> tuple[dict, float]:
    """``(times, mfu)``: the totals of each kind of work (``compute_s``; ``tp_s``, ``dp_s``,
    ``cpu_s``: bytes / bandwidth), the overlapped step time ``step_s`` and its exposed parts
    (:func:`hybrid.planner.step_time.step_breakdown`), and the model-FLOPs utilisation that
    step time gives (2205.05198 Eq. 7 FLOPs / (step_s * GPUs * peak)). ``traffic``: dp, tp, host
    and inter-node dp bytes (the rest of the dp bytes move at the intra-node bandwidth)."""
    dp_bytes, tp_bytes, cpu_bytes, inter = traffic
    model_flops = flops_per_iteration(m, gbs, training.seq_length, "none")
    peak = cluster.num_gpus * cluster.peak_tflops * 1e12
    dp_bw = (cluster.inter_node_gbs if cluster.num_gpus > cluster.gpus_per_node
             else cluster.intra_node_gbs)
    times = step_breakdown(m, cluster, training, tp, dp, stage, activation, prec, threshold,
                           micro_batches, cpu_bytes, offloaded)
    times.update(tp_s=tp_bytes / (cluster.intra_node_gbs * GB),
                 dp_s=inter / (dp_bw * GB) + (dp_bytes - inter) / (cluster.intra_node_gbs * GB),
                 cpu_s=cpu_bytes / (cluster.cpu_gbs * GB))
    times["dp_exposed_s"] = sum(times[k] for k in EXPOSED_DP)
    times["exposed_s"] = times["step_s"] - times["compute_s"]
    return times, model_flops / (times["step_s"] * peak)


def _wgrad_fused(training: Training) -> bool:
    """16-bit weights with fp32 gradients under ``--gradient-accumulation-fusion``: at stages 0/1
    the weight-gradient GEMMs accumulate into the fp32 buffer
    (:mod:`hybrid.parallel.linear.main_grad`; assumes the device has such a GEMM, as CUDA torch
    and apex do)."""
    return (training.zero.gradient_accumulation_fusion and not training.zero.grad_reduce_in_bf16
            and training.zero.precision != "fp32")


def evaluate(
    model: GPTConfig, cluster: Cluster, training: Training, tp: int, stage: int, activation: str,
    offload_fraction: float = 0.0,
) -> Candidate:
    """Memory, traffic and estimated step time of one layout (see the module docstring);
    ``offload_fraction`` of the rank's optimizer partition on the host (ZeRO-Offload,
    :mod:`hybrid.planner.offload`).

    Raises ValueError for an impossible layout (tp not dividing heads or GPUs, a global batch
    that is not a multiple of micro batch * dp, sequence parallelism with tp not dividing the
    sequence length, ZeroConfig's refusals: offload at ZeRO stage 0 or a fraction outside [0, 1]).
    """
    m, training = _check_layout(model, cluster, training, tp, activation,
                                (stage, offload_fraction))
    dp = cluster.num_gpus // tp
    s, b = training.seq_length, training.micro_batch_size
    gbs, micro_batches = _batch(training, cluster, dp)
    prec = _precision(training)
    psi_t = params_per_tp_rank(m, tp)
    zero = training.zero.plan  # the stage's partitioning (hybrid.zero.stage.stage_plan)
    persistent = persistent_parameters(m, tp, zero.persistence_threshold)
    partition = psi_t if stage == 0 else -(-psi_t // dp)
    states, host_states = _states(m, cluster, training, tp, dp, stage, prec, persistent,
                                  offload_fraction)
    offloaded = offloaded_elements(partition, offload_fraction)
    acts = activation_bytes(m, s, b, tp, activation, prec, dropout=training.dropout)
    host = host_bytes(host_states, acts["cpu"], cluster.gpus_per_node)
    buffers = _buffer_bytes(m, tp, dp, stage, prec, psi_t, training)
    temps = temporary_bytes(m, s, b, tp, stage, activation, prec.activation_bytes,
                            model.vocab_size, acts["layers"], training.dropout,
                            wgrad_fused=_wgrad_fused(training))
    bucket = min(max(1, training.zero.reduce_bucket_size // dp), -(-psi_t // dp)) * dp
    # the bytes that phase allocates; the activations are freed by then, so its peak is above
    # the other phases' (states + activ + temps) only by what it allocates beyond them
    temps["embedding_backward"] = embedding_backward_bytes(
        m, tp, stage, prec.activation_bytes, bucket, 0, training.zero.overlap_comm)
    temps["total"] = max(temps["total"], temps["embedding_backward"] - acts["gpu"])
    total = states["total"] + acts["gpu"] + temps["total"] + buffers + int(cluster.reserved_bytes)
    dp_kinds, tp_bytes, cpu_bytes = _traffic(m, tp, dp, stage, prec, micro_batches, persistent,
                                             activation, training, acts, cluster.gpus_per_node)
    dp_bytes, inter = _zeropp_bytes(dp_kinds, cluster, training, tp, dp, stage, prec, psi_t,
                                    persistent, micro_batches)
    times, mfu = _step_times(m, cluster, training, gbs, tp, dp, stage, activation, prec,
                             zero.persistence_threshold, micro_batches,
                             (dp_bytes, tp_bytes, cpu_bytes, inter), offloaded)
    device_fits = total <= cluster.gpu_memory_bytes
    host_fits = host["node"] <= cluster.host_memory_bytes
    return Candidate(
        tp=tp, dp=dp, stage=stage, activation=activation, micro_batches=micro_batches,
        micro_batch_size=b,
        params_per_rank=psi_t, model_states=states, activations=acts, buffers=buffers,
        total_bytes=total, fits=device_fits and host_fits, dp_bytes=dp_bytes,
        tp_bytes=tp_bytes, cpu_bytes=cpu_bytes, times=times,
        tokens_per_s=gbs * s / times["step_s"], mfu=mfu, dp_bytes_by_kind=dp_kinds,
        persistent_params=persistent, temporaries=temps, offload_fraction=offload_fraction,
        host_bytes=host, offload_bytes=offloaded * (prec.grad_bytes + prec.param_bytes),
        device_fits=device_fits, host_fits=host_fits, inter_node_dp_bytes=inter,
    )


def _states(m: GPTConfig, cluster: Cluster, training: Training, tp: int, dp: int, stage: int,
            prec, persistent: int, offload_fraction: float) -> tuple[dict, dict]:
    """``(device, host)`` model-state bytes per rank: ZeRO's Table 2 + hpZ's secondary shard,
    less the host's ``offload_fraction`` of the optimizer partition; ValueError from ZeRO++."""
    psi_t = params_per_tp_rank(m, tp)
    states = model_state_bytes(m, tp, dp, stage, prec, persistent)
    if stage == 3:
        zeropp.check(training, cluster, tp)
    extra = zeropp.secondary_bytes(psi_t, persistent, training, prec, stage)  # hpZ
    states = {**states, "params": states["params"] + extra, "total": states["total"] + extra}
    partition = psi_t if stage == 0 else -(-psi_t // dp)
    return split_states(states, partition, offload_fraction, prec)


def _zeropp_bytes(dp_kinds: dict, cluster: Cluster, training: Training, tp: int, dp: int,
                  stage: int, prec, psi_t: int, persistent: int,
                  micro_batches: int) -> tuple[float, float]:
    """``(dp bytes, of which inter-node)`` per rank per step; ZeRO++ sets stage 3's gather bytes
    in ``dp_kinds`` (in place); qgZ's intra-node all-to-all stays in the node."""
    if stage == 3:
        dp_kinds["all_gather"] = sum(zeropp.gather_bytes(psi_t, persistent, dp, micro_batches,
                                                         training, prec, stage).values())
    dp_bytes = sum(dp_kinds.values())
    inter = zeropp.inter_node_bytes(dp_bytes, psi_t, persistent, dp, micro_batches, training,
                                    prec, stage, cluster, tp)
    if inter:
        inter -= qgz_intra_bytes(dp_kinds, training, cluster.gpus_per_node, tp, dp, stage)
    return dp_bytes, inter


def micro_batch_choices(global_batch: int, dp: int) -> list[int]:
    """Micro-batch sizes b with ``global_batch % (b * dp) == 0``, ascending (the divisors of
    global_batch / dp; Megatron-LM's rule: global batch = b * accumulation steps * dp); [] when
    dp does not divide the global batch."""
    if global_batch % dp:
        return []
    per_rank = global_batch // dp
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def plan(
    model: GPTConfig,
    cluster: Cluster,
    training: Training,
    tps: list[int] | None = None,
    stages: tuple[int, ...] = ZERO_STAGES,
    activations: tuple[str, ...] = ACTIVATION_OPTIONS,
    micro_batch_sizes: tuple[int, ...] | None = None,
    search_micro_batch: bool = False,
    offload_fractions: tuple[float, ...] = OFFLOAD_SEARCH,
) -> tuple[list[Candidate], list[str]]:
    """Evaluate every layout; returns (candidates, reasons for the layouts that were skipped).

    ``tps`` None means ``tp_candidates``. "full+pa" and the sequence-parallel options are
    skipped at tp = 1, where partitioning over one rank is plain checkpointing and sequence
    parallelism is off. Micro-batch sizes: ``micro_batch_sizes`` when given, else every one
    that divides the global batch over dp (:func:`micro_batch_choices`) with
    ``search_micro_batch``, else ``training.micro_batch_size``; the global batch stays
    ``training``'s (default: its micro-batch size * GPUs). ``offload_fractions``: the
    ZeRO-Offload shares tried at stages 1-3 (:mod:`hybrid.planner.offload`; default off and all
    on; stage 0 takes 0 only, and is skipped with the reason when 0 is not among them).
    """
    m = model
    if tps is None:
        tps = tp_candidates(m, cluster)
    for tp in tps:
        check_tp(m, tp, cluster)
    gbs = training.global_batch_size or training.micro_batch_size * cluster.num_gpus
    out, skipped = [], []
    for tp in tps:
        sizes = micro_batch_sizes or (
            micro_batch_choices(gbs, cluster.num_gpus // tp) if search_micro_batch else ())
        for b in sizes or (training.micro_batch_size,):
            t = dataclasses.replace(training, micro_batch_size=b, global_batch_size=gbs)
            _plan_tp(m, cluster, t, tp, (stages, activations, offload_fractions), out, skipped)
    return out, skipped


def _plan_tp(m, cluster, training, tp, search, out, skipped) -> None:
    """Evaluate every stage, activation option and offload fraction of ``search`` at ``tp``
    into ``out`` (or ``skipped``)."""
    stages, activations, fractions = search
    for stage, act, frac in itertools.product(stages, activations, fractions):
        sp = "sp" in act.split("+")
        if tp == 1 and act == "full+pa" or sp and not sequence_parallel_active(sp, tp):
            continue
        if stage == 0 and frac > 0 and 0.0 in fractions:
            continue  # stage 0 is planned without offload: it has no partition to move
        try:
            out.append(evaluate(m, cluster, training, tp, stage, act, frac))
        except ValueError as err:
            reason = f"tp={tp}: {err}"
            if reason not in skipped:
                skipped.append(reason)


def best(candidates: list[Candidate]) -> Candidate | None:
    """The fitting candidate (GPU and host memory) with the smallest step time (ties: less
    offloaded, lower stage, smaller total)."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (round(c.times["step_s"], 9), c.offload_fraction, c.stage,
                                       c.total_bytes))
