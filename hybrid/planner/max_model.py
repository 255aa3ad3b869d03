"""The reverse planner question: the largest model that fits (arXiv 1910.02054 Table 2 and §10.5).

:func:`max_params` inverts the model-state bytes per parameter (activations and buffers ignored,
as in the paper); :func:`max_layers` bisects the layer count with everything counted.
"""

from __future__ import annotations

import dataclasses
import math

from hybrid.planner.memory import state_bytes_per_param
from hybrid.planner.plan import Cluster, Training, evaluate
from hybrid.planner.precision import get_precision
from hybrid.zero.config import ZeroConfig
from models.config import GPTConfig


def max_params(
    memory_bytes: float,
    tp: int,
    dp: int,
    stage: int,
    precision: str = "bf16",
    accounting: str = "paper",
) -> int:
    """Largest parameter count whose model states fit ``memory_bytes`` per GPU (elements).

    ZeRO Table 2 inversion: Ψ_max = memory * tp / bytes-per-param(stage, dp), activations and
    buffers ignored as in the paper (32 GB, N_d = 64, tp = 1: 2.0B / 7.64B / 14.4B / 128B).
    """
    if memory_bytes <= 0 or tp <= 0:
        raise ValueError(f"memory_bytes and tp must be positive, got {memory_bytes}, {tp}")
    prec = get_precision(precision, accounting)
    return math.floor(memory_bytes * tp / state_bytes_per_param(stage, dp, prec))


def max_params_offloaded(
    memory_bytes: float,
    host_memory_bytes: float,
    ranks_per_node: int,
    tp: int,
    dp: int,
    stage: int,
    precision: str = "bf16",
    accounting: str = "paper",
    fraction: float = 1.0,
) -> int:
    """:func:`max_params` with ``fraction`` of each rank's optimizer partition on the host
    (ZeRO-Offload, :mod:`hybrid.planner.offload`), elements; 0 at stage 0 (no partition).

    The GPU holds ``bytes-per-param(stage, dp) - F k / dp`` per parameter of its TP shard; the
    node's ``ranks_per_node`` ranks hold ``F (k + grad_bytes) / dp`` each on the host, which
    ``host_memory_bytes`` bounds too: Ψ_max = min(memory * tp / device bytes, host * tp /
    (ranks * host bytes)). Engine bf16 at dp = 1: 18 -> 6 bytes, 3x the model (the paper's
    16 -> 4: 4x; ZeRO-Offload §1's 10x also moves the 16-bit gradients and counts activations).

    Raises:
        ConfigError: a fraction ``ZeroConfig`` refuses (outside [0, 1]).
    """
    if stage == 0:
        return 0
    prec = get_precision(precision, accounting)
    f = ZeroConfig(stage=stage, optimizer_cpu_offload=True,  # its refusals
                   optimizer_offload_fraction=fraction).optimizer_offload_fraction
    device = state_bytes_per_param(stage, dp, prec) - f * prec.k / dp
    host = ranks_per_node * f * (prec.k + prec.grad_bytes) / dp
    limits = [memory_bytes * tp / device] + ([host_memory_bytes * tp / host] if host else [])
    return math.floor(min(limits))


def max_layers(
    model: GPTConfig,
    cluster: Cluster,
    training: Training,
    tp: int,
    stage: int,
    activation: str,
    limit: int = 100_000,
) -> int:
    """Largest num_layers (other dimensions from ``model``) that fits, counting everything.

    Memory grows monotonically with the layer count, so this bisects; 0 if even one layer does not
    fit. Use it for the activation-aware version of the max-model question (ZeRO §10.5, Fig. 6).
    """
    m = model

    def fits(layers: int) -> bool:
        return evaluate(
            dataclasses.replace(m, num_layers=layers), cluster, training, tp, stage, activation
        ).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
