"""Optional fused kernels: NVIDIA apex when it is importable on a CUDA run, torch's own otherwise.

apex is never a requirement (and the unrelated PyPI package named ``apex`` must not be
installed for it). With apex, LayerNorms become ``apex.normalization.FusedLayerNorm``, which
has the same ``weight``/``bias`` parameters, so names, checkpoints and the TP specs are
unchanged. The optimizer uses ``torch.optim.AdamW``'s own fused/foreach implementations.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def fused_layer_norm_class():
    """apex's FusedLayerNorm class, or None when apex or its CUDA extension is missing.

    ``pip install apex`` without ``--cpp_ext --cuda_ext`` installs the Python package alone;
    its ``FusedLayerNorm.__init__`` then fails importing ``fused_layer_norm_cuda``, so the
    extension itself is probed here, not only the package.
    """
    try:
        from apex.normalization import FusedLayerNorm
    except Exception:  # ImportError, or a broken apex build
        return None
    import importlib.util

    try:
        if importlib.util.find_spec("fused_layer_norm_cuda") is None:
            return None
    except (ImportError, ValueError):
        return None
    return FusedLayerNorm


def use_fused_kernels(model: nn.Module, device: torch.device) -> int:
    """Swap every ``nn.LayerNorm`` of ``model`` for apex's fused one on CUDA, in place.

    Returns:
        The number of modules swapped (0 on CPU or without apex).
    """
    cls = fused_layer_norm_class()
    if cls is None or device.type != "cuda":
        return 0
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.LayerNorm:
            continue
        if module.weight.is_meta:  # built unit by unit later by the ZeRO engine
            with torch.device("meta"):
                fused = cls(module.normalized_shape, eps=module.eps, elementwise_affine=True)
        else:
            fused = cls(module.normalized_shape, eps=module.eps, elementwise_affine=True)
            with torch.no_grad():
                fused.weight.copy_(module.weight)
                fused.bias.copy_(module.bias)
        for old, new in ((module.weight, fused.weight), (module.bias, fused.bias)):
            if hasattr(old, "tp_spec"):
                new.tp_spec = old.tp_spec
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                fused if module.weight.is_meta else fused.to(device))
        swapped += 1
    return swapped
