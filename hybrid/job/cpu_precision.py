"""A warning for 16-bit training on a CPU without native 16-bit arithmetic.

On a CPU, torch computes bf16 and fp16 matrix products natively only where the instruction set
has them: on x86 ``avx512_bf16`` or ``amx_bf16`` for bf16 and ``avx512_fp16`` or ``amx_fp16``
for fp16 (the ``flags`` of ``/proc/cpuinfo``); on Arm the ``bf16`` and ``fphp`` / ``asimdhp``
features (its ``Features`` line). Elsewhere every 16-bit op converts to fp32 and back, and a
step is several times slower than in fp32: a user measured 4.7-7x (2.3-3.7 s against ~0.5 s
per iteration, tp 2 x dp 2 ZeRO-3, bf16, on a CPU without ``avx512_bf16``). The trainer warns
once at start-up (rank 0) naming the missing feature; fp32 (no ``--bf16`` / ``--fp16``) is the
fast choice there.
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


def warn_if_slow(precision: str, device_type: str, path: str = "/proc/cpuinfo") -> str | None:
    """Warn (once per process, ``UserWarning``) when ``precision`` runs on a CPU
    (``device_type == 'cpu'``) without native support; returns the message, or None."""
    if device_type != "cpu":
        return None
    message = slow_precision_message(precision, cpu_features(path))
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    return message
