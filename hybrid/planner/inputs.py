"""What the planner is asked about: the machines (:class:`Cluster`) and what one step does
(:class:`Training`); :mod:`hybrid.planner.plan` evaluates layouts of a model on them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybrid.devices import GIB
from hybrid.planner.precision import get_precision
from hybrid.zero.config import ZeroConfig

GB = 1e9  # bandwidths only (GB/s, as links are quoted); memory is shown in GiB (devices.GIB)


@dataclass(frozen=True)
class Cluster:
    """The machines: GPU count and memory, speeds the cost model uses."""

    num_gpus: int
    """GPUs in the job (tp * dp)."""
    gpus_per_node: int = 8
    """GPUs sharing one NVLink domain; TP never crosses it."""
    gpu_memory_bytes: float = 80 * GIB
    """Memory per GPU in bytes (the A100-80GB reports 80 GiB; :mod:`hybrid.devices`)."""
    reserved_bytes: float = 1 * GIB
    """Held back per GPU for the CUDA context, allocator fragmentation, temporaries (bytes)."""
    peak_tflops: float = 312.0
    """Dense bf16/fp16 peak per GPU in TFLOP/s (``flops.device_peak_tflops``)."""
    efficiency: float = 0.45
    """Fraction of peak the GEMMs achieve."""
    intra_node_gbs: float = 200.0
    """Achieved per-GPU collective bandwidth inside a node, GB/s."""
    inter_node_gbs: float = 25.0
    """Achieved per-GPU collective bandwidth across nodes, GB/s."""
    cpu_gbs: float = 20.0
    """Per-GPU host link bandwidth, GB/s one way (PCIe: P_a+cpu's checkpoints, ZeRO-Offload's
    gradients and parameters; ``hybrid.devices`` presets give the GPU's link)."""
    hbm_gbs: float = 2039.0
    """GPU memory bandwidth, GB/s (the optimizer step is bound by it; A100-80GB SXM datasheet)."""
    host_memory_bytes: float = 2048 * GIB
    """Host DRAM per node, bytes: the limit on what the node's ranks keep on the host
    (ZeRO-Offload's optimizer states, P_a+cpu's checkpoints); a DGX A100 640GB's 2 TB."""
    host_memory_gbs: float = 409.6
    """Host DRAM peak bandwidth per node, GB/s (the host AdamW step is bound by it; DGX A100: 2
    sockets x 8 channels x DDR4-3200 x 8 B)."""
    host_efficiency: float = 0.5
    """Fraction of ``host_memory_gbs`` the host AdamW sustains (``hybrid.planner.offload``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name != "reserved_bytes"):
                raise ValueError(f"{f.name} must be positive, got {value}")
        if self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus={self.num_gpus} is not divisible by gpus_per_node={self.gpus_per_node}"
            )
        for name in ("efficiency", "host_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name} is a fraction of peak in (0, 1], got "
                                 f"{getattr(self, name):g}")


def paper_zero() -> ZeroConfig:
    """:class:`Training`'s default ZeRO settings: 16-bit training (bf16) with every parameter
    partitioned at stage 3 (no persistence threshold), as the ZeRO paper counts; ``hybrid.plan``
    builds its own from its flags (:func:`hybrid.planner.cli_args.zero_config`)."""
    return ZeroConfig(precision="bf16", param_persistence_threshold=0)


@dataclass(frozen=True)
class Training:
    """What one step does: the batch, and the run's :class:`ZeroConfig` (``zero``), whose
    settings (precision, buckets, gradient collective, ZeRO++ and the rest) the planner prices
    and whose validation refuses what the run would refuse."""

    seq_length: int
    """Tokens per sequence s."""
    micro_batch_size: int = 1
    """Sequences per rank per forward/backward b."""
    global_batch_size: int | None = None
    """Sequences per optimizer step; None = micro_batch_size * num_gpus."""
    accounting: str = "paper"
    """'paper': ZeRO §3.1 bytes per parameter (2 + 2 + 12; the paper's tables); 'engine': what
    ``hybrid.zero.engine.ZeroEngine`` holds and sends (fp32 gradients, separate fp32 master: 18
    B/param in 16-bit, 20 in fp32). See ``hybrid.planner.memory``."""
    zero: ZeroConfig = field(default_factory=paper_zero)
    """The run's ZeRO settings, as ``hybrid.pretrain`` takes them. The planner searches the stage
    and the offload fraction: :func:`hybrid.planner.plan.evaluate` plans a layout with
    :func:`layout_zero` of it (the stage's own settings, :meth:`ZeroConfig.at_stage`), so this
    one's ``stage`` is the highest searched (where each setting given applies) and its offload
    what ``--optimizer-cpu-offload`` forces."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padded to a multiple of this * tp (Megatron §5.1)."""
    tp_comm_overlap: bool = False
    """Megatron-LM's ``--tp-comm-overlap``: under sequence parallelism the block linears'
    all-gathers and reduce-scatters are rings pipelined with their GEMMs
    (``hybrid.planner.step_time.ring_exposed``); no effect on layouts without SP."""
    dropout: bool = True
    """The model trains with dropout (Megatron's default 0.1): masks saved, the attention core
    explicit; False (Llama recipes): no masks, SDPA (``hybrid.planner.activations``)."""

    def __post_init__(self) -> None:
        get_precision(self.zero.precision, self.accounting)
        for name in ("seq_length", "micro_batch_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {self.global_batch_size}")


def layout_zero(zero: ZeroConfig, stage: int, offload_fraction: float = 0.0) -> ZeroConfig:
    """The :class:`ZeroConfig` of one planned layout: ``zero`` at ZeRO ``stage`` (the settings
    that stage does not take off, :meth:`ZeroConfig.at_stage`) with ``offload_fraction`` of each
    rank's optimizer partition on the host (``--optimizer-cpu-offload
    --optimizer-offload-fraction``; 0: none).

    Raises:
        ConfigError: what ZeroConfig refuses, e.g. offload at stage 0 or a fraction outside
            [0, 1] (a ``ValueError`` naming the flag).
    """
    if offload_fraction == 0:
        return zero.at_stage(stage, optimizer_cpu_offload=False)
    return zero.at_stage(stage, optimizer_cpu_offload=True,
                         optimizer_offload_fraction=offload_fraction)
