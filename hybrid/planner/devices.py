"""GPU presets for the planner: memory per GPU and dense bf16/fp16 tensor-core peak.

Figures are the vendors' datasheets, dense (the datasheets' headline tensor figures for A100,
H100 and H200 are "with sparsity", twice the dense rate):

* V100-32GB: NVIDIA V100 Tensor Core GPU datasheet (SXM2): 125 TFLOP/s tensor (fp16; V100 has
  no bf16), 32 GB HBM2.
* A100-40GB, A100-80GB: NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16/FP16 tensor core
  312 TFLOP/s (624 with sparsity), 40 GB HBM2 / 80 GB HBM2e.
* H100: NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16/FP16 tensor core 1,979 TFLOP/s
  with sparsity, so 989 dense; 80 GB HBM3.
* H200: NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16/FP16 tensor core 1,979 TFLOP/s
  with sparsity, so 989 dense; 141 GB HBM3e.

Memory is the datasheet figure read in the planner's GB (1e9 bytes), as the ZeRO paper
(arXiv:1910.02054, §5) counts its 32 GB V100; the hardware holds that many GiB (7% more),
and what the CUDA context and allocator take is the planner's separate ``--reserved-gb``.
The peaks agree with :data:`hybrid.flops.DEVICE_PEAK_TFLOPS` (the MFU of real runs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePreset:
    """One GPU model: ``memory_gb`` in GB (1e9 bytes), ``peak_tflops`` dense bf16/fp16."""

    name: str
    memory_gb: float
    peak_tflops: float


DEVICE_PRESETS: dict[str, DevicePreset] = {
    p.name.lower(): p
    for p in (
        DevicePreset("V100-32GB", 32.0, 125.0),
        DevicePreset("A100-40GB", 40.0, 312.0),
        DevicePreset("A100-80GB", 80.0, 312.0),
        DevicePreset("H100", 80.0, 989.0),
        DevicePreset("H200", 141.0, 989.0),
    )
}
DEFAULT_DEVICE = "A100-80GB"


def device_preset(name: str) -> DevicePreset | None:
    """The preset called ``name`` (case-insensitive), or None."""
    return DEVICE_PRESETS.get(name.lower())


def preset_names() -> str:
    """``"V100-32GB, A100-40GB, ..."`` for help texts and errors."""
    return ", ".join(p.name for p in DEVICE_PRESETS.values())
