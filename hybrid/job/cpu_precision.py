"""A warning for 16-bit training on a CPU without native 16-bit arithmetic.

On a CPU, torch computes bf16 and fp16 matrix products natively only where the instruction set
has them: on x86 ``avx512_bf16`` or ``amx_bf16`` for bf16 and ``avx512_fp16`` or ``amx_fp16``
for fp16 (the ``flags`` of ``/proc/cpuinfo``); on Arm the ``bf16`` and ``fphp`` / ``asimdhp``
features (its ``Features`` line). Elsewhere every 16-bit op converts to fp32 and back, and a
step is several times slower than in fp32: a user measured 4.7-7x (2.3-3.7 s against ~0.5 s
per iteration, tp 2 x dp 2 ZeRO-3, bf16, on a CPU without ``avx512_bf16``). The trainer warns
once at start-up (rank 0) naming the missing feature; fp32 (no ``--bf16`` / ``--fp16``) is the
fast choice there.

On CUDA the opposite trap: fp32 (no ``--bf16`` / ``--fp16``) with PyTorch's default
``torch.backends.cuda.matmul.allow_tf32 = False`` runs every GEMM in true fp32, several times
below the tensor cores' TF32 / bf16 rate. Megatron-LM does not change that setting either (its
NGC containers set ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``); turning TF32 on silently would
change the numerics a user asked for, so the trainer warns once instead
(:func:`fp32_cuda_message`).
"""

from __future__ import annotations

import warnings

# precision -> (x86 flags, Arm features): any one of them means native arithmetic
NATIVE_FEATURES = {
    "bf16": (("avx512_bf16", "amx_bf16"), ("bf16",)),
    "fp16": (("avx512_fp16", "amx_fp16"), ("fphp", "asimdhp")),
}
SLOWDOWN = "4.7-7x slower per iteration than fp32, as a user measured for bf16"


def cpu_features(path: str = "/proc/cpuinfo") -> tuple[str, set[str]] | None:
    """``(kind, features)`` of this CPU from ``path``: kind ``'x86'`` (its ``flags`` line) or
    ``'arm'`` (its ``Features`` line); None when the file is unreadable or has neither (macOS,
    Windows: no warning rather than a wrong one)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features"):
                    return ("x86" if key == "flags" else "arm"), set(value.split())
    except OSError:
        return None
    return None


def slow_precision_message(precision: str, features: tuple[str, set[str]] | None) -> str | None:
    """The warning for training in ``precision`` on a CPU with ``features``
    (:func:`cpu_features`), or None: fp32, a CPU with native support, or unknown features."""
    if precision not in NATIVE_FEATURES or features is None:
        return None
    kind, have = features
    wanted = NATIVE_FEATURES[precision][0 if kind == "x86" else 1]
    if have & set(wanted):
        return None
    import torch

    return (f"--{precision} on a CPU without native {precision} arithmetic (no "
            f"{' / '.join(wanted)} in its {'flags' if kind == 'x86' else 'Features'}; torch's "
            f"CPU kernels: {torch.backends.cpu.get_cpu_capability()}): every {precision} op "
            f"converts through fp32, expect {SLOWDOWN}; train in fp32 (drop --{precision}) "
            "on this machine, or use a GPU")


def fp32_cuda_message(precision: str, device_type: str, tf32: bool) -> str | None:
    """The warning for true-fp32 GEMMs on CUDA (``tf32``: TF32 matmuls allowed), or None."""
    if device_type != "cuda" or precision != "fp32" or tf32:
        return None
    return ("fp32 on CUDA without --bf16 / --fp16: every GEMM runs in true fp32 (PyTorch's "
            "default torch.backends.cuda.matmul.allow_tf32 = False, which Megatron-LM keeps "
            "too), several times below the tensor cores' rate; train with --bf16, or set "
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 for TF32 GEMMs")


def tf32_allowed() -> bool:
    """Whether CUDA GEMMs may use TF32: ``torch.backends.cuda.matmul.allow_tf32`` or the
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` environment variable."""
    import os

    import torch

    return (bool(torch._C._get_cublas_allow_tf32())
            or os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1")


def warn_if_slow(precision: str, device_type: str, path: str = "/proc/cpuinfo") -> str | None:
    """Warn (once per process, ``UserWarning``) when ``precision`` runs on a CPU
    (``device_type == 'cpu'``) without native support, or in true fp32 on CUDA
    (:func:`fp32_cuda_message`); returns the message, or None."""
    if device_type == "cuda":
        message = fp32_cuda_message(precision, device_type, tf32_allowed())
    elif device_type != "cpu":
        return None
    else:
        message = slow_precision_message(precision, cpu_features(path))
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    return message
