"""GPU presets for the planner and the dry run: memory per GPU (GiB) and dense bf16/fp16 peak.

One unit for memory everywhere, GiB (2^30 bytes): the planner's table, the dry run's report and
the device capacities below, which are the total memory each GPU reports to CUDA (what
``nvidia-smi`` prints in MiB and ``torch.cuda.mem_get_info`` in bytes), not the datasheets'
rounded "GB":

* V100-32GB (SXM2): 32,510 MiB = 31.75 GiB; 125 TFLOP/s fp16 tensor (no bf16).
* A100-40GB (SXM4): 40,536 MiB = 39.59 GiB; A100-80GB (SXM4): 81,920 MiB = 80.00 GiB;
  BF16/FP16 tensor core 312 TFLOP/s dense (624 with sparsity).
* H100 (SXM5 80GB HBM3): 81,559 MiB = 79.65 GiB; 989 TFLOP/s dense (1,979 with sparsity).
* H200 (SXM 141GB HBM3e): 143,771 MiB = 140.40 GiB; 989 TFLOP/s dense.

Peaks are the vendors' datasheets (dense: their headline tensor figures for A100, H100 and H200
are "with sparsity") and agree with :data:`hybrid.flops.DEVICE_PEAK_TFLOPS`. What the CUDA
context and the allocator take is the separate reserve (``--reserved-gib``, default 1 GiB).

The host side (ZeRO-Offload, arXiv 2101.06840, and P_a+cpu), per GPU model the server NVIDIA
builds around it (DGX-1 V100, DGX A100 320GB / 640GB, DGX H100, DGX H200 datasheets):

* ``host_link_gbs``, GB/s one way per GPU: the GPU's PCIe x16 link (Gen3 8, Gen4 16, Gen5 32
  GT/s per lane, 128b/130b coding: 15.75, 31.5, 63 GB/s each way; the datasheets' 32, 64 and
  128 GB/s are both ways together) at 80%, what a pinned-memory copy achieves once the packet
  headers are paid: V100 12.6, A100 25.2, H100 and H200 50.4.
* ``host_memory_gib``, GiB of DRAM per node (DIMMs come in binary sizes): DGX-1 512, DGX A100
  320GB 1,024, DGX A100 640GB / DGX H100 / DGX H200 2,048 ("2 TB").
* ``host_memory_gbs``, GB/s DRAM peak per node: two sockets x channels x transfer rate x 8 B:
  DGX-1 2 x Xeon E5-2698 v4, 4 x DDR4-2400 = 153.6; DGX A100 2 x EPYC 7742, 8 x DDR4-3200 =
  409.6; DGX H100 / H200 2 x Xeon Platinum 8480C, 8 x DDR5-4800 = 614.4.

The network between nodes, ``inter_node_gbs``, GB/s per GPU one way (the planner's data-parallel
collectives across nodes; ``--inter-node-gbs`` overrides it): the server's compute-fabric
adapters at line rate, shared by its GPUs (1 Gb/s = 0.125 GB/s; :data:`NETWORK_SOURCES`):

* DGX-1 V100: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs = 6.25 (the ZeRO paper's DGX-2, 8 x 100
  Gb/s for 16 GPUs, gives the same);
* DGX A100 (320GB and 640GB): 8 x 200 Gb/s HDR InfiniBand (ConnectX-6), one per GPU = 25;
* DGX H100 and DGX H200: 8 x 400 Gb/s NDR InfiniBand (ConnectX-7), one per GPU = 50.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
"""The one memory unit of the planner and the dry run (bytes)."""
DEFAULT_RESERVED_GIB = 1.0
"""Held back per GPU for the CUDA context and allocator fragmentation (GiB)."""


@dataclass(frozen=True)
class DevicePreset:
    """One GPU model: ``memory_gib`` in GiB as CUDA reports it, ``peak_tflops`` dense
    bf16/fp16, ``hbm_gbs`` memory bandwidth in GB/s (datasheets; the planner's optimizer time);
    its server's host side (module docstring): ``host_link_gbs`` GB/s each way per GPU,
    ``host_memory_gib`` GiB and ``host_memory_gbs`` GB/s peak DRAM per node; and its network,
    ``inter_node_gbs`` GB/s per GPU one way (line rate of the server's adapters)."""

    name: str
    memory_gib: float
    peak_tflops: float
    hbm_gbs: float = 2039.0
    host_link_gbs: float = 25.2
    host_memory_gib: float = 2048.0
    host_memory_gbs: float = 409.6
    inter_node_gbs: float = 25.0


DEVICE_PRESETS: dict[str, DevicePreset] = {
    p.name.lower(): p
    for p in (
        DevicePreset("V100-32GB", 32_510 / 1024, 125.0, 900.0, 12.6, 512.0, 153.6, 6.25),
        DevicePreset("A100-40GB", 40_536 / 1024, 312.0, 1555.0, 25.2, 1024.0, 409.6, 25.0),
        DevicePreset("A100-80GB", 81_920 / 1024, 312.0, 2039.0, 25.2, 2048.0, 409.6, 25.0),
        DevicePreset("H100", 81_559 / 1024, 989.0, 3350.0, 50.4, 2048.0, 614.4, 50.0),
        DevicePreset("H200", 143_771 / 1024, 989.0, 4800.0, 50.4, 2048.0, 614.4, 50.0),
    )
}
DEFAULT_DEVICE = "A100-80GB"
NETWORK_SOURCES: dict[str, str] = {
    "V100-32GB": "DGX-1, 4 x 100 Gb/s EDR InfiniBand per 8 GPUs",
    "A100-40GB": "DGX A100, 8 x 200 Gb/s HDR InfiniBand per 8 GPUs",
    "A100-80GB": "DGX A100, 8 x 200 Gb/s HDR InfiniBand per 8 GPUs",
    "H100": "DGX H100, 8 x 400 Gb/s NDR InfiniBand per 8 GPUs",
    "H200": "DGX H200, 8 x 400 Gb/s NDR InfiniBand per 8 GPUs",
}
"""Where each preset's ``inter_node_gbs`` comes from: its server's compute-fabric adapters
(datasheets), for the planner's header; adapters x line rate / 8 / GPUs = GB/s per GPU."""
SPELLINGS: dict[str, str] = {
    "V100-32GB": "V100-SXM2-32GB V100-32GB-SXM2 V100-SXM2",
    "A100-40GB": "A100-SXM4-40GB A100-40GB-SXM4 A100-SXM-40GB",
    "A100-80GB": "A100-SXM4-80GB A100-80GB-SXM4 A100-SXM-80GB",
    "H100": "H100-80GB H100-SXM H100-SXM5 H100-SXM-80GB H100-SXM5-80GB H100-80GB-HBM3",
    "H200": "H200-141GB H200-SXM H200-SXM-141GB H200-141GB-HBM3E",
}
"""The one table of the other names each preset goes by (datasheets, cloud catalogues, and
``nvidia-smi`` / ``torch.cuda.get_device_name``, whose ``NVIDIA`` / ``Tesla`` prefix is
dropped): matched case-insensitively, spaces and underscores read as ``-``. A bare ``A100`` or
``V100`` names two memory sizes and stays refused; PCIe cards (another peak) are no preset."""


def _key(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``."""
    words = name.lower().replace("_", " ").replace("-", " ").split()
    if words and words[0] in ("nvidia", "tesla"):
        words = words[1:]
    return "-".join(words)


def device_preset(name: str) -> DevicePreset | None:
    """The preset called ``name`` or one of its :data:`SPELLINGS` (case-insensitive), or
    None."""
    key = _key(name)
    for preset, others in SPELLINGS.items():
        if key in (_key(n) for n in others.split()):
            key = preset.lower()
    return DEVICE_PRESETS.get(key)


def preset_names() -> str:
    """``"V100-32GB, A100-40GB, ..."`` for help texts and errors."""
    return ", ".join(p.name for p in DEVICE_PRESETS.values())


def device_memory_gib(device: str | None, memory_gib: float | None,
                      reserved_gib: float = DEFAULT_RESERVED_GIB) -> float:
    """The memory of one GPU in GiB: ``memory_gib`` when given, else ``device``'s preset (None:
    :data:`DEFAULT_DEVICE`). Shared by ``hybrid.plan`` and the dry run's verdict.

    Raises:
        ValueError: a non-positive memory, a negative reserve or one that leaves nothing, or a
            ``device`` that is no preset without ``memory_gib``; the message names the flag
            (``--gpu-memory-gib``, ``--reserved-gib``, ``--device``) and the valid values.
    """
    if memory_gib is not None and memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be positive (GiB per GPU), got {memory_gib:g}")
    if reserved_gib < 0:
        raise ValueError("--reserved-gib must be 0 or more (GiB held back per GPU), got "
                         f"{reserved_gib:g}")
    if memory_gib is None:
        preset = device_preset(device or DEFAULT_DEVICE)
        if preset is None:
            raise ValueError(f"--device {device!r} is no preset ({preset_names()}); give "
                             "--gpu-memory-gib (the presets' usual spellings are accepted too: "
                             "H100-80GB, H100-SXM5, A100-SXM4-80GB, ...)")
        memory_gib = preset.memory_gib
    if reserved_gib >= memory_gib:
        raise ValueError(f"--reserved-gib {reserved_gib:g} leaves nothing of the GPU's "
                         f"{memory_gib:.2f} GiB; give less than that")
    return memory_gib


def gib_text(x: float) -> str:
    """A size in GiB for a sentence, rounded as the tables round: 2 decimals, trailing zeros
    dropped (``27.9397`` -> ``27.94``, ``1.0`` -> ``1``); below 1 GiB two significant digits,
    so a test's tiny GPU still shows its size (``0.005``)."""
    return f"{round(x, 2):g}" if abs(x) >= 1 else f"{x:.2g}"


def fit_verdict(peak_bytes: float, memory_gib: float, reserved_gib: float,
                what: str = "step peak") -> tuple[bool, str]:
    """``(fits, sentence)``: whether ``peak_bytes`` (a rank's step peak, named ``what`` in the
    sentence) plus the reserve fit one GPU of ``memory_gib`` GiB, the planner's rule
    (``total = peak + reserve <= memory``), and a sentence saying by how much, in GiB."""
    need = peak_bytes / GIB + reserved_gib
    margin = memory_gib - need
    d = 2 if memory_gib >= 1 else 4  # a test's tiny GPU still shows its bytes

    def gib(x: float) -> str:
        return f"{x:.{d}f} GiB"

    how = f"{gib(margin)} to spare" if margin >= 0 else f"{gib(-margin)} over"
    return margin >= 0, (f"{'fits' if margin >= 0 else 'does NOT fit'}: "
                         f"{gib(peak_bytes / GIB)} {what} + {gib_text(reserved_gib)} GiB reserve = "
                         f"{gib(need)} of the GPU's {gib(memory_gib)} ({how})")
