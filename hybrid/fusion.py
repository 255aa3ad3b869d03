"""Fused kernels: which elementwise chains run compiled (:class:`FusionConfig`, Megatron-LM's
fusion flags), and NVIDIA apex's fused norms when their CUDA extension imports.

:func:`apply_kernel_fusion` sets :class:`models.fusion.KernelFusion` on the model's modules
and, when the norms are fused on CUDA and apex's extension loads, gives the norms apex's
kernels (``fused_layer_norm_affine`` / ``fused_rms_norm_affine``, the functions behind
``FusedLayerNorm`` / ``FusedRMSNorm``). The norm modules stay: their arithmetic (the
zero-centred ``1 + w`` of ``--apply-layernorm-1p``, the TP-summed weight of sequence
parallelism) runs around whichever kernel, so names, checkpoints and TP specs are unchanged.
apex is never a requirement (and the unrelated PyPI package named ``apex`` must not be
installed for it).

Default ``--kernel-fusion auto``: fused on CUDA, eager on CPU. On CPU the compiled regions
buy little (CPU elementwise ops are memory-bound loops either way) and cost a compile per
region and shape (inductor builds C++: 10-30 s each on a 2-core machine, in every test and
short run), and the eager path is the one the golden losses pin bit for bit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybrid.config_fields import arg, check_choice
from models.fusion import OFF, KernelFusion, set_kernel_fusion

KERNEL_FUSION_CHOICES = ("auto", "on", "off")


@dataclass
class FusionConfig:
    """Fused elementwise kernels (torch.compile regions; apex's norms when importable)."""

    kernel_fusion: str = arg("auto", "fuse the elementwise chains (norms, bias-GeLU, "
                                     "bias-SwiGLU, bias-dropout-add, RoPE) into compiled "
                                     "kernels: auto = on CUDA only, on, off = the eager path",
                             choices=KERNEL_FUSION_CHOICES)
    bias_gelu_fusion: bool = arg(True, "fuse the MLP's bias and GeLU (when --kernel-fusion "
                                       "is in effect)")
    bias_swiglu_fusion: bool = arg(True, "fuse SwiGLU and its biases (when --kernel-fusion "
                                         "is in effect)")
    bias_dropout_fusion: bool = arg(True, "fuse each branch's bias, dropout and residual add "
                                          "(when --kernel-fusion is in effect)")
    apply_rope_fusion: bool = arg(True, "fuse RoPE on q and k (when --kernel-fusion is in "
                                        "effect)", flag="--rope-fusion")

    def __post_init__(self) -> None:
        check_choice(self, "kernel_fusion", KERNEL_FUSION_CHOICES)

    def resolve(self, device: torch.device | str) -> KernelFusion:
        """The :class:`KernelFusion` of a run on ``device`` (see the module docstring)."""
        on = self.kernel_fusion == "on" or (self.kernel_fusion == "auto"
                                           and torch.device(device).type == "cuda")
        if not on:
            return OFF
        return KernelFusion(norm=True, bias_gelu=self.bias_gelu_fusion,
                            bias_swiglu=self.bias_swiglu_fusion,
                            bias_dropout=self.bias_dropout_fusion, rope=self.apply_rope_fusion)


def apply_kernel_fusion(model: nn.Module, fusion: KernelFusion, device: torch.device) -> str:
    """Set ``fusion`` on ``model`` and, with fused norms on CUDA, give the norms apex's kernels.

    Returns:
        One line for the start-up log: the fused chains that ``model`` has (a GPT: no SwiGLU,
        no RoPE) and the norms' kernel.
    """
    set_kernel_fusion(model, fusion)
    if not fusion.names():
        return "kernel fusion: off (eager elementwise ops)"
    names = fusion.names(model)
    on_apex = use_fused_kernels(model, device) if fusion.norm else 0
    norms = f"apex ({on_apex} norms)" if on_apex else "compiled"
    return f"kernel fusion: {', '.join(names)} (torch.compile; norms {norms})"


def apex_norm_kernels() -> dict[str, Callable] | None:
    """apex's fused norm kernels as ``{"layer": f, "rms": f}``, each ``f(x, weight, bias, eps)``
    over the last dimension of ``x`` ``[..., n]`` (``bias`` None for RMS), or None when apex or
    its CUDA extension does not load.

    ``pip install apex`` without ``--cpp_ext --cuda_ext`` installs the Python package alone, and
    a build for another torch or CUDA leaves an extension that fails to load (undefined symbols):
    the extension ``fused_layer_norm_cuda`` is imported here, not only found, so a norm never
    reaches a kernel that cannot run.
    """
    try:
        importlib.import_module("fused_layer_norm_cuda")
        from apex.normalization import fused_layer_norm as apex_norm

        layer, rms = apex_norm.fused_layer_norm_affine, apex_norm.fused_rms_norm_affine
    except Exception:  # ImportError, OSError, AttributeError: a missing or broken apex build
        return None

    def layer_kernel(x, weight, bias, eps):
        return layer(x, weight, bias, (x.shape[-1],), eps)

    def rms_kernel(x, weight, bias, eps):
        return rms(x, weight, (x.shape[-1],), eps)

    return {"layer": layer_kernel, "rms": rms_kernel}


def use_fused_kernels(model: nn.Module, device: torch.device) -> int:
    """Give every norm of ``model`` apex's fused kernel on CUDA, in place.

    Each norm keeps its module, parameters and arithmetic
    (:meth:`models.norms.NormArithmetic.normalize`: the zero-centred ``1 + w`` scale included,
    and under sequence parallelism the TP-summed weight); only the kernel that ``fusion.norm``
    runs changes, from the compiled region to apex's.

    Returns:
        The number of norms given apex's kernel (0 on CPU or without apex).
    """
    from models.norms import NormArithmetic, RMSNorm

    kernels = apex_norm_kernels() if device.type == "cuda" else None
    if kernels is None:
        return 0
    norms = [m for m in model.modules() if isinstance(m, NormArithmetic)]
    for norm in norms:
        norm.fused_kernel = kernels["rms" if isinstance(norm, RMSNorm) else "layer"]
    return len(norms)
