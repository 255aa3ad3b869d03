"""Fused kernels: which elementwise chains run compiled (:class:`FusionConfig`, Megatron-LM's
fusion flags), and NVIDIA apex's fused norms when their CUDA extension imports.

:func:`apply_kernel_fusion` sets :class:`models.fusion.KernelFusion` on the model's modules
and, when the norms are fused on CUDA and apex imports, swaps the norms for apex's
(``apex.normalization.FusedLayerNorm`` / ``FusedRMSNorm``: the same ``weight``/``bias``
parameters, so names, checkpoints and the TP specs are unchanged). apex is never a
requirement (and the unrelated PyPI package named ``apex`` must not be installed for it).

Default ``--kernel-fusion auto``: fused on CUDA, eager on CPU. On CPU the compiled regions
buy little (CPU elementwise ops are memory-bound loops either way) and cost a compile per
region and shape (inductor builds C++: 10-30 s each on a 2-core machine, in every test and
short run), and the eager path is the one the golden losses pin bit for bit.
"""

from __future__ import annotations

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
    """Set ``fusion`` on ``model`` and, with fused norms on CUDA, swap in apex's norms.

    Returns:
        One line for the start-up log: the fused chains that ``model`` has (a GPT: no SwiGLU,
        no RoPE) and the norms' kernel.
    """
    set_kernel_fusion(model, fusion)
    if not fusion.names():
        return "kernel fusion: off (eager elementwise ops)"
    names = fusion.names(model)  # before apex's norms replace ours
    swapped = use_fused_kernels(model, device) if fusion.norm else 0
    norms = f"apex ({swapped} swapped)" if swapped else "compiled"
    return f"kernel fusion: {', '.join(names)} (torch.compile; norms {norms})"


def fused_layer_norm_class(name: str = "FusedLayerNorm"):
    """apex's ``name`` class (FusedLayerNorm, FusedRMSNorm), or None when apex, the class or
    its CUDA extension is missing.

    ``pip install apex`` without ``--cpp_ext --cuda_ext`` installs the Python package alone;
    its ``FusedLayerNorm.__init__`` then fails importing ``fused_layer_norm_cuda``, so the
    extension itself is probed here, not only the package.
    """
    try:
        import apex.normalization

        cls = getattr(apex.normalization, name)
    except Exception:  # ImportError, AttributeError or a broken apex build
        return None
    import importlib.util

    try:
        if importlib.util.find_spec("fused_layer_norm_cuda") is None:
            return None
    except (ImportError, ValueError):
        return None
    return cls


def use_fused_kernels(model: nn.Module, device: torch.device) -> int:
    """Swap every LayerNorm / RMSNorm module of ``model`` for apex's fused one on CUDA, in place.

    Returns:
        The number of modules swapped (0 on CPU or without apex).
    """
    from models.fused import RMSNorm

    if device.type != "cuda":
        return 0
    kinds = ((nn.LayerNorm, fused_layer_norm_class()),
             (RMSNorm, fused_layer_norm_class("FusedRMSNorm")))
    swapped = 0
    for name, module in list(model.named_modules()):
        cls = next((c for kind, c in kinds if isinstance(module, kind)), None)
        if cls is None or isinstance(module, cls):
            continue
        fused = _apex_norm(cls, module)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                fused if module.weight.is_meta else fused.to(device))
        swapped += 1
    return swapped


def _apex_norm(cls, module: nn.Module) -> nn.Module:
    """An apex norm of ``cls`` with ``module``'s shape, eps, values and TP specs."""
    if module.weight.is_meta:  # built unit by unit later by the ZeRO engine
        with torch.device("meta"):
            fused = cls(module.normalized_shape, eps=module.eps, elementwise_affine=True)
    else:
        fused = cls(module.normalized_shape, eps=module.eps, elementwise_affine=True)
        with torch.no_grad():
            fused.weight.copy_(module.weight)
            if getattr(module, "bias", None) is not None:
                fused.bias.copy_(module.bias)
    for attr in ("weight", "bias"):
        old, new = getattr(module, attr, None), getattr(fused, attr, None)
        if old is not None and new is not None and hasattr(old, "tp_spec"):
            new.tp_spec = old.tp_spec
    return fused
