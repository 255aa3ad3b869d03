"""What the planner is asked about: the machines (:class:`Cluster`) and what one step does
(:class:`Training`); :mod:`hybrid.planner.plan` evaluates layouts of a model on them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybrid.devices import GIB
from hybrid.planner.precision import get_precision

GB = 1e9  # bandwidths only (GB/s, as links are quoted); memory is shown in GiB (devices.GIB)
DEFAULT_BUCKET_ELEMENTS = 50_000_000


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


@dataclass(frozen=True)
class Training:
    """What one step does."""

    seq_length: int
    """Tokens per sequence s."""
    micro_batch_size: int = 1
    """Sequences per rank per forward/backward b."""
    global_batch_size: int | None = None
    """Sequences per optimizer step; None = micro_batch_size * num_gpus."""
    precision: str = "bf16"
    """'bf16' / 'fp16' (mixed, 16 B/param) or 'fp32' (4 param + 4 grad + 8 Adam)."""
    accounting: str = "paper"
    """'paper': ZeRO §3.1 bytes per parameter (2 + 2 + 12; the paper's tables); 'engine': what
    ``hybrid.zero.engine.ZeroEngine`` holds and sends (fp32 gradients, separate fp32 master: 18
    B/param in 16-bit, 20 in fp32). See ``hybrid.planner.memory``."""
    param_persistence_threshold: int = 0
    """Stage 3 keeps local parameters with fewer elements than this whole (ZeroConfig's field of
    the same name, default 100,000 there); 0 partitions everything, as the paper counts."""
    reduce_bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    """Gradient reduce bucket, elements."""
    allgather_bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    """Stage-3 parameter gather bucket, elements."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padded to a multiple of this * tp (Megatron §5.1)."""
    grad_reduce: str = "reduce_scatter"
    """ZeroConfig.grad_reduce: 'reduce_scatter' or 'all_reduce' (2x the gradient bytes)."""
    overlap_comm: bool = True
    """Two reduce-scatter staging buffers (reduction overlapped with backward) instead of one."""
    grad_reduce_in_bf16: bool = False
    """Megatron-LM's --grad-reduce-in-bf16 (bf16 training only): gradients held, staged and
    reduced in bf16, 2 bytes instead of the engine's 4 (``grad_bytes``)."""
    gradient_accumulation_fusion: bool = True
    """ZeroConfig's default: stage 1 reduce-scatters each unit in place in the gradient buffer,
    with no staging buffers (``memory.comm_buffer_bytes``)."""
    overlap_param_gather: bool = False
    """Megatron-LM's ``--overlap-param-gather`` (its default, off): ZeRO 1-2's all-gather of the
    updated parameters is launched after the step and waited block by block in the next
    forward instead of before the step returns (``hybrid.planner.step_time``)."""
    tp_comm_overlap: bool = False
    """Megatron-LM's ``--tp-comm-overlap``: under sequence parallelism the block linears'
    all-gathers and reduce-scatters are rings pipelined with their GEMMs
    (``hybrid.planner.step_time.ring_exposed``); no effect on layouts without SP."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (``--zero-quantized-gradients``): stages 2-3 reduce-scatter the gradients as
    blockwise int4/int8 payloads through an intra-node then an inter-node all-to-all
    (``hybrid.planner.traffic.qgz_bytes_per_element``); stages 0-1 keep the exact collective."""
    quantized_gradients_bits: int = 4
    """qgZ's code width, 4 or 8 (``--zero-quantized-gradients-bits``)."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ (stage 3): secondary parameter shard over this many data-parallel ranks of a
    node; 1 off (``hybrid.planner.zeropp``)."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): int8 parameter gathers (``hybrid.planner.zeropp``)."""
    dropout: bool = True
    """The model trains with dropout (Megatron's default 0.1): masks saved, the attention core
    explicit; False (Llama recipes): no masks, SDPA (``hybrid.planner.activations``)."""

    def __post_init__(self) -> None:
        get_precision(self.precision, self.accounting)
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            raise ValueError(f"grad_reduce_in_bf16 needs precision bf16, got {self.precision!r}")
        if self.quantized_gradients and self.precision == "fp32":
            raise ValueError("quantized_gradients needs 16-bit training (qgZ replaces 16-bit "
                             "gradient reduce-scatters), got precision 'fp32'")
        if self.quantized_gradients and self.grad_reduce == "all_reduce":
            raise ValueError("quantized_gradients replaces the gradient reduce-scatter; "
                             "grad_reduce is all_reduce (use reduce_scatter, the default)")
        if self.quantized_gradients_bits not in (4, 8):
            raise ValueError(f"quantized_gradients_bits must be 4 or 8, got "
                             f"{self.quantized_gradients_bits}")
        if self.hpz_partition_size < 1:
            raise ValueError(f"hpz_partition_size must be >= 1, got {self.hpz_partition_size}")
        if self.quantized_weights and self.precision == "fp32":
            raise ValueError("quantized_weights needs 16-bit parameters (precision bf16 or fp16)")
        if self.param_persistence_threshold < 0:
            raise ValueError(
                f"param_persistence_threshold must be >= 0, got {self.param_persistence_threshold}"
            )
        for name in (
            "seq_length",
            "micro_batch_size",
            "reduce_bucket_elements",
            "allgather_bucket_elements",
            "make_vocab_size_divisible_by",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {self.global_batch_size}")
