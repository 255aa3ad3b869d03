"""The planner's flag groups (training, cluster, search) for :mod:`hybrid.planner.cli`.

Units as there: memory in GiB (2^30 bytes; the ``--*-gb`` spellings are GB, 10^9 bytes,
converted), bandwidths in GB/s, bucket sizes in elements.
"""

from __future__ import annotations

import argparse
import dataclasses

from hybrid.devices import (
    DEFAULT_DEVICE,
    DEFAULT_RESERVED_GIB,
    GIB,
    NETWORK_SOURCES,
    DevicePreset,
    preset_names,
)
from hybrid.field_flags import key_of
from hybrid.model_flags import _finite
from hybrid.planner.inputs import Cluster, Training
from hybrid.planner.memory import ACTIVATION_OPTIONS, ZERO_STAGES
from hybrid.planner.offload import OFFLOAD_SEARCH
from hybrid.planner.precision import ACCOUNTINGS, PRECISIONS
from hybrid.zero.config import ZeroConfig


def add_training_args(g) -> None:
    g.add_argument("--micro-batch-size", type=int, action="append",
                   help="restrict to this micro-batch b, samples per rank (repeatable; default: "
                   "every b dividing --global-batch-size / dp when that is given, else 1)")
    g.add_argument("--global-batch-size", type=int,
                   help="default (the first --micro-batch-size or 1) * num-gpus")
    g.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                   help="training precision")
    g.add_argument("--accounting", choices=ACCOUNTINGS, default="engine",
                   help="model-state bytes per param: what this trainer's engine holds (18 "
                   "bf16, 20 fp32: fp32 gradient accumulation), or the ZeRO paper's (16 mixed, "
                   "its tables)")
    g.add_argument("--grad-reduce", choices=("reduce_scatter", "all_reduce"),
                   default="reduce_scatter",
                   help="the engine's gradient collective for ZeRO 1-3 (all_reduce: 2x the "
                   "gradient bytes)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="bf16 gradients, held and reduced in 2 bytes (Megatron-LM's flag; "
                   "--precision bf16 only)")
    g.add_argument("--zero-quantized-gradients", action="store_true",
                   help="ZeRO++ qgZ: stages 2-3 reduce-scatter gradients as blockwise int4/int8 "
                   "through an intra- then an inter-node all-to-all (DeepSpeed's "
                   "zero_quantized_gradients; 16-bit precision only)")
    g.add_argument("--zero-quantized-gradients-bits", type=int, choices=(4, 8), default=4,
                   help="qgZ code width (4: DeepSpeed's int4)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="the engine without gradient-accumulation fusion (ZeRO-1 then stages "
                   "its reduce-scatter through two bucket buffers)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO 1-2: the updated parameters' all-gather runs during the next "
                   "forward instead of after the step (Megatron-LM's flag and default, off)")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="sequence-parallel layouts pipeline the blocks' TP all-gathers and "
                   "reduce-scatters with their GEMMs (Megatron-LM's flag, off by default)")
    g.add_argument("--zero-hpz-partition-size", type=int, default=1,
                   help="ZeRO++ hpZ at stage 3: secondary parameter shard over this many "
                   "data-parallel ranks of a node, backward gathers inside it (1: off)")
    g.add_argument("--zero-quantized-weights", action="store_true",
                   help="ZeRO++ qwZ at stage 3: int8 parameter gathers (1 + 4/2048 bytes per "
                   "element; 16-bit precision only)")
    g.add_argument("--param-persistence-threshold", type=int, default=100_000,
                   help="stage 3 keeps local params with fewer elements whole, as the engine "
                   "(0: the paper's count, every parameter partitioned)")
    g.add_argument("--reduce-bucket-size", type=int, default=50_000_000,
                   help="elements")
    g.add_argument("--allgather-bucket-size", type=int, default=50_000_000,
                   help="elements")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="vocabulary padded to a multiple of this times tp (Megatron-LM)")


def _decimal_gb_as_gib(text: str) -> float:
    """argparse type: a finite size in GB (10^9 bytes) returned in GiB (2^30 bytes)."""
    return _finite(text) * 1e9 / GIB


def _positive_gb_as_gib(text: str) -> float:
    """argparse type of ``--gpu-memory-gb``: :func:`_decimal_gb_as_gib` of a positive size, so
    that 0 is refused under the flag given (the shared check names ``--gpu-memory-gib``)."""
    if _finite(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (GB = 10^9 bytes per GPU), got {text}")
    return _decimal_gb_as_gib(text)


def add_cluster_args(g) -> None:
    g.add_argument("--num-gpus", type=int, default=8, help="GPUs in the job (tp * dp)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="tp never crosses a node (default: 8, or --num-gpus when fewer: one node)")
    g.add_argument("--device", help=f"GPU preset, memory as CUDA reports it (GiB) and dense "
                   f"bf16/fp16 peak from the datasheet: {preset_names()} (default: "
                   f"{DEFAULT_DEVICE}); another name (V100S, H100 PCIe...) gives only the peak")
    # each size in one unit: the GiB flag or the GB one, never both (argparse names the pair)
    memory = g.add_mutually_exclusive_group()
    memory.add_argument("--gpu-memory-gib", dest="gpu_memory_gb", type=_finite, metavar="GIB",
                        help="memory per GPU in GiB = 2^30 bytes, as nvidia-smi and torch.cuda "
                        "report it (default: the --device preset's)")
    memory.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=_positive_gb_as_gib,
                        metavar="GB", help="the same in GB = 10^9 bytes, converted to GiB "
                        "(80 GB = 74.51 GiB); not with --gpu-memory-gib")
    reserved = g.add_mutually_exclusive_group()
    reserved.add_argument("--reserved-gib", dest="reserved_gb", type=_finite, metavar="GIB",
                          default=DEFAULT_RESERVED_GIB,
                          help="GiB held back per GPU for the CUDA context and fragmentation, "
                          "shown in the reserve column and counted in total (0 reproduces the "
                          "ZeRO tables)")
    reserved.add_argument("--reserved-gb", dest="reserved_gb", type=_decimal_gb_as_gib,
                          metavar="GB", help="the same in GB = 10^9 bytes, converted to GiB; "
                          "not with --reserved-gib")
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
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int,
                   action="append", help="restrict to this TP degree (repeatable; default: "
                   "every divisor that fits a node)")
    g.add_argument("--zero-stage", type=int, action="append", choices=ZERO_STAGES,
                   help="restrict to this ZeRO stage (repeatable; default: all)")
    g.add_argument("--activation", action="append", choices=ACTIVATION_OPTIONS,
                   help="restrict to this activation checkpointing (repeatable; default: all)")
    offload = g.add_mutually_exclusive_group()
    offload.add_argument("--optimizer-cpu-offload", action="store_true", default=None,
                         help="plan only layouts whose optimizer runs on the host (ZeRO-Offload;"
                         " Megatron-LM's flag; default: searched, none, half or all of it)")
    offload.add_argument("--no-optimizer-cpu-offload", dest="optimizer_cpu_offload",
                         action="store_false",
                         help="plan only layouts whose optimizer stays on the GPU")
    g.add_argument("--optimizer-offload-fraction", type=_finite, metavar="F",
                   help="share of each rank's optimizer on the host when offloaded, in [0, 1] "
                   "(Megatron-LM's flag; default 1.0 as there, and the search tries 0, 0.5, 1)")
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
