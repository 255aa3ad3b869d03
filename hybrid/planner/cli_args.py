"""The planner's flag groups (training, cluster, search) for :mod:`hybrid.planner.cli`.

A flag ``hybrid.pretrain`` also takes is built from the same :func:`hybrid.config_fields.arg`
field (:func:`hybrid.field_flags.add_field`: name, help, type, choices, aliases): the batch,
ZeRO, grid and GPU settings here, the model's in :func:`hybrid.model_flags.add_model_args`. What
the planner searches keeps its planner meaning, changed at the declaration's use only:
``--tp``, ``--zero-stage`` and ``--micro-batch-size`` are repeatable and restrict the search
(default: all), ``--optimizer-cpu-offload`` / ``--no-optimizer-cpu-offload`` force one side of
the offload search and ``--optimizer-offload-fraction`` its share (default: searched), and the
default precision is bf16. The planner's ZeRO settings become the run's :class:`ZeroConfig`
(:func:`zero_config`), whose validation refuses what the run would.

Units as there: memory in GiB (2^30 bytes; the ``--*-gb`` spellings are GB, 10^9 bytes,
converted), bandwidths in GB/s, bucket sizes in elements.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from hybrid.config import DryRunConfig, GridConfig, ModelConfig, TrainingConfig
from hybrid.devices import (
    DEFAULT_DEVICE,
    GIB,
    NETWORK_SOURCES,
    DevicePreset,
    preset_names,
)
from hybrid.field_flags import add_field, key_of
from hybrid.planner.inputs import Cluster, Training
from hybrid.planner.memory import ACTIVATION_OPTIONS, ZERO_STAGES
from hybrid.planner.offload import OFFLOAD_SEARCH
from hybrid.planner.precision import ACCOUNTINGS
from hybrid.zero.config import ZeroConfig


def _field(section: type, name: str):
    """The :func:`hybrid.config_fields.arg` field ``name`` of config section ``section``."""
    return next(f for f in dataclasses.fields(section) if f.name == name)


def _searched(section: type, name: str, how: str) -> str:
    """The field's help, then what the planner does with it (``how``: searches it, say)."""
    return f"{_field(section, name).metadata['help']}; hybrid.plan: {how}"


def _add(g, section: type, *names: str) -> None:
    """The flags of fields ``names`` of ``section``, as ``hybrid.pretrain`` declares them."""
    for name in names:
        add_field(g, _field(section, name))


def _finite(text: str) -> float:
    """argparse type: a float that is a number (nan and inf would pass every comparison check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_training_args(g) -> None:
    """The batch and the run's ZeRO settings: ``hybrid.pretrain``'s flags, from its fields
    (:mod:`hybrid.field_flags`); ``--micro-batch-size`` is searched, ``--precision`` defaults
    to bf16."""
    add_field(g, _field(TrainingConfig, "micro_batch_size"), action="append", default=None,
              help=_searched(TrainingConfig, "micro_batch_size", "restrict to this micro-batch "
                             "b (repeatable; default: every b dividing --global-batch-size / dp "
                             "when that is given, else 1)"))
    _add(g, TrainingConfig, "global_batch_size")
    add_field(g, _field(ZeroConfig, "precision"), default="bf16",
              help=_searched(ZeroConfig, "precision", "default bf16 (hybrid.pretrain's: fp32)"))
    g.add_argument("--accounting", choices=ACCOUNTINGS, default="engine",
                   help="model-state bytes per param: what this trainer's engine holds (18 "
                   "bf16, 20 fp32: fp32 gradient accumulation), or the ZeRO paper's (16 mixed, "
                   "its tables)")
    _add(g, ZeroConfig, "grad_reduce", "grad_reduce_in_bf16", "quantized_gradients",
         "quantized_gradients_bits", "gradient_accumulation_fusion", "overlap_param_gather")
    _add(g, GridConfig, "tp_comm_overlap")
    _add(g, ZeroConfig, "hpz_partition_size", "quantized_weights", "param_persistence_threshold",
         "reduce_bucket_size", "allgather_bucket_size")
    _add(g, ModelConfig, "make_vocab_size_divisible_by")


def _decimal_gb_as_gib(text: str) -> float:
    """argparse type: a finite size in GB (10^9 bytes) returned in GiB (2^30 bytes)."""
    return _finite(text) * 1e9 / GIB


def _positive_gb_as_gib(text: str) -> float:
    """argparse type of ``--gpu-memory-gb``: :func:`_decimal_gb_as_gib` of a positive size, so
    that 0 is refused under the flag given (the shared check names ``--gpu-memory-gib``)."""
    if _finite(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (GB = 10^9 bytes per GPU), got {text}")
    return _decimal_gb_as_gib(text)


def _add_gpu_args(g) -> None:
    """``--device``, ``--gpu-memory-gib`` and ``--reserved-gib`` (the fields the dry run's
    verdict takes, whose default it shares: the planner's help, finite sizes, and each size in
    one unit: the GiB flag or the GB one, never both, argparse names the pair)."""
    add_field(g, _field(DryRunConfig, "device"),
              help=f"GPU preset, memory as CUDA reports it (GiB) and dense bf16/fp16 peak from the "
                   f"datasheet: {preset_names()} (default: {DEFAULT_DEVICE}); another name "
                   "(V100S, H100 PCIe...) gives only the peak")
    memory = g.add_mutually_exclusive_group()
    add_field(memory, _field(DryRunConfig, "gpu_memory_gib"), dest="gpu_memory_gb", type=_finite,
              metavar="GIB", help="memory per GPU in GiB = 2^30 bytes, as nvidia-smi and "
              "torch.cuda report it (default: the --device preset's)")
    memory.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=_positive_gb_as_gib,
                        metavar="GB", default=argparse.SUPPRESS,  # --gpu-memory-gib's default
                        help="the same in GB = 10^9 bytes, converted to GiB (80 GB = 74.51 "
                        "GiB); not with --gpu-memory-gib")
    reserved = g.add_mutually_exclusive_group()
    add_field(reserved, _field(DryRunConfig, "reserved_gib"), dest="reserved_gb", type=_finite,
              metavar="GIB", help="GiB held back per GPU for the CUDA context and "
              "fragmentation, shown in the reserve column and counted in total (0 reproduces the "
              f"ZeRO tables) (default: {_field(DryRunConfig, 'reserved_gib').default!r})")
    reserved.add_argument("--reserved-gb", dest="reserved_gb", type=_decimal_gb_as_gib,
                          metavar="GB", default=argparse.SUPPRESS,  # --reserved-gib's default
                          help="the same in GB = 10^9 bytes, converted to GiB; not with "
                          "--reserved-gib")


def add_cluster_args(g) -> None:
    g.add_argument("--num-gpus", type=int, default=8, help="GPUs in the job (tp * dp)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="tp never crosses a node (default: 8, or --num-gpus when fewer: one node)")
    _add_gpu_args(g)
    g.add_argument("--peak-tflops", type=_finite,
                   help="dense peak per GPU, TFLOP/s (default: the --device preset's)")
    g.add_argument("--efficiency", type=_finite, default=0.45, help="fraction of peak on GEMMs")
    g.add_argument("--intra-node-gbs", type=_finite,
                   help="NVLink, GB/s per GPU (default: 200)")
    g.add_argument("--inter-node-gbs", type=_finite,
                   help="network between nodes, GB/s per GPU one way (default: the --device "
                   "preset's server, its adapters' line rate: V100 6.25, A100 25, H100 and H200 "
                   "50 (8 x 400 Gb/s NDR per 8 GPUs); else 25)")
    g.add_argument("--cpu-gbs", type=_finite, help="host link (PCIe), GB/s one way per GPU "
                   "(default: the --device preset's, else 20)")
    g.add_argument("--hbm-gbs", type=_finite, help="GPU memory bandwidth, GB/s, for the "
                   "optimizer step (default: the --device preset's, else 2039)")
    g.add_argument("--host-memory-gib", type=_finite, metavar="GIB",
                   help="host DRAM per node in GiB, the limit on what its ranks keep there "
                   "(offloaded optimizer, P_a+cpu checkpoints); default: the --device preset's "
                   "DGX (2048 for A100-80GB, H100, H200; less what the OS and data loaders "
                   "need is yours to take off)")
    g.add_argument("--host-dram-gbs", type=_finite, help="host DRAM peak bandwidth per node, "
                   "GB/s, for the host AdamW of --optimizer-cpu-offload (default: the --device "
                   "preset's DGX, e.g. 614.4 for H100)")
    g.add_argument("--host-efficiency", type=_finite, default=0.5,
                   help="fraction of --host-dram-gbs the host AdamW sustains")


def add_search_args(g) -> None:
    """What the planner searches: tp, the ZeRO stage (``hybrid.pretrain``'s flags, each given
    restricts the search), the activation options and the offload (searched unless given)."""
    add_field(g, _field(GridConfig, "tensor_model_parallel_size"), flags=("--tp",), dest="tp",
              action="append", default=None,
              help=_searched(GridConfig, "tensor_model_parallel_size", "restrict to this TP "
                             "degree (repeatable; default: every divisor that fits a node)"))
    add_field(g, _field(ZeroConfig, "stage"), action="append", default=None,
              help=_searched(ZeroConfig, "stage", "restrict to this ZeRO stage (repeatable; "
                             "default: all)"))
    g.add_argument("--activation", action="append", choices=ACTIVATION_OPTIONS,
                   help="restrict to this activation checkpointing (repeatable; default: all)")
    add_field(g, _field(ZeroConfig, "optimizer_cpu_offload"), default=None,
              negation="plan only layouts whose optimizer stays on the GPU",
              help=_searched(ZeroConfig, "optimizer_cpu_offload", "plan only layouts whose "
                             "optimizer runs on the host (default: searched, none, half or all "
                             "of it)"))
    add_field(g, _field(ZeroConfig, "optimizer_offload_fraction"), default=None, metavar="F",
              help=_searched(ZeroConfig, "optimizer_offload_fraction", "default 1.0 with "
                             "--optimizer-cpu-offload, else the search tries 0, 0.5 and 1"))
    g.add_argument("--fitting-only", action="store_true", help="print only layouts that fit")
    g.add_argument("--max-model", action="store_true",
                   help="largest model per TP x stage (ZeRO Table 2: model states only; with "
                   "model dims also the largest layer count counting activations)")


def zero_config(args: argparse.Namespace) -> ZeroConfig:
    """The run's :class:`ZeroConfig` of the planner's flags (each ZeroConfig flag's value, or its
    default), at the highest ``--zero-stage`` searched: every setting given must apply at one of
    the stages searched, and ZeroConfig's validation refuses it otherwise, as ``hybrid.pretrain``
    would refuse it at every one. ``--optimizer-cpu-offload`` is on only when given (the search
    plans the fractions of :func:`offload_fractions` per layout, ``evaluate``).

    Raises:
        ConfigError: what ZeroConfig refuses (a ``ValueError`` naming the flag and value).
    """
    given = vars(args)
    values = {f.name: given[key_of(f)] for f in dataclasses.fields(ZeroConfig)
              if given.get(key_of(f)) is not None}
    stages = values.pop("stage", None) or ZERO_STAGES
    values["optimizer_cpu_offload"] = bool(values.get("optimizer_cpu_offload"))
    zero = ZeroConfig(stage=max(stages), **values)
    for stage in stages:
        zero.at_stage(stage)  # each stage given is one ZeroConfig takes
    return zero


def offload_fractions(args: argparse.Namespace, zero: ZeroConfig) -> tuple[float, ...]:
    """The offload fractions to plan: ``--optimizer-offload-fraction`` (``zero``'s, default 1.0,
    Megatron-LM's) alone with ``--optimizer-cpu-offload``, 0 alone with
    ``--no-optimizer-cpu-offload``; else the search: 0 and the fraction given, or
    ``offload.OFFLOAD_SEARCH``."""
    if args.optimizer_cpu_offload is False:
        return (0.0,)
    if args.optimizer_cpu_offload:
        return (zero.optimizer_offload_fraction,)
    if args.optimizer_offload_fraction is None:
        return OFFLOAD_SEARCH
    return tuple(sorted({0.0, zero.optimizer_offload_fraction}))


def network(args: argparse.Namespace, preset: DevicePreset | None) -> dict[str, tuple]:
    """The cluster's two bandwidths, ``{"intra_node_gbs" | "inter_node_gbs": (GB/s per GPU,
    where it came from)}``: the flag given, else the ``--device`` preset's (between nodes: its
    server's adapters, :data:`hybrid.devices.NETWORK_SOURCES`), else ``Cluster``'s default."""
    intra = ((args.intra_node_gbs, "--intra-node-gbs") if args.intra_node_gbs is not None
             else (Cluster.intra_node_gbs, "default; --intra-node-gbs"))
    if args.inter_node_gbs is not None:
        inter = (args.inter_node_gbs, "--inter-node-gbs")
    elif preset is not None:
        inter = (preset.inter_node_gbs,
                 f"the {preset.name} preset's: {NETWORK_SOURCES[preset.name]}; --inter-node-gbs")
    else:
        inter = (Cluster.inter_node_gbs, "default; --inter-node-gbs")
    return {"intra_node_gbs": intra, "inter_node_gbs": inter}


def assumed_line(args: argparse.Namespace, preset: DevicePreset | None, cluster: Cluster,
                 training: Training, from_preset: dict) -> str:
    """The header line naming what the plan assumed and where each came from (a flag, the
    ``--model`` preset's recipe, the ``--device`` preset or a default): the global batch, in
    sequences and tokens per step, and the bandwidths of :func:`network`."""
    b, n = training.micro_batch_size, cluster.num_gpus
    gbs = training.global_batch_size or b * n
    if "--global-batch-size" in from_preset:
        source = f"the {args.model} preset's"
    elif args.global_batch_size is not None:
        source = "--global-batch-size"
    else:
        source = f"--micro-batch-size {b} x {n} GPUs: no --global-batch-size"
    bw = network(args, preset)
    (intra, intra_from), (inter, inter_from) = bw["intra_node_gbs"], bw["inter_node_gbs"]
    unused = " (unused: one node)" if n <= cluster.gpus_per_node else ""
    return (f"assumed: global batch {gbs:,} sequences = {gbs * training.seq_length:,} tokens per "
            f"step ({source}); per GPU, NVLink {intra:g} GB/s ({intra_from}), between nodes "
            f"{inter:g} GB/s{unused} ({inter_from})")
