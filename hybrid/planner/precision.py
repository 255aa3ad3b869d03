"""Bytes per parameter of each model state and per activation element, in two accountings:
ZeRO §3.1 (arXiv 1910.02054; ``paper``) and what ``hybrid.zero.engine.ZeroEngine`` allocates
(``engine``: fp32 gradient accumulation, a separate fp32 master). See ``hybrid.planner.memory``."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and bytes per activation element."""

    name: str
    param_bytes: int
    """Working copy used by forward/backward."""
    grad_bytes: int
    """Gradient as produced by backward and communicated by data parallelism."""
    master_bytes: int
    """fp32 master copy of the parameters kept by the optimizer (0 when params are fp32)."""
    optimizer_bytes: int
    """Adam momentum + variance (2 x fp32)."""
    activation_bytes: int
    """Bytes per stored activation element (dropout masks are always 1 byte)."""
    accounting: str = "paper"
    """'paper' (ZeRO §3.1) or 'engine' (what ``hybrid.zero.engine.ZeroEngine`` allocates)."""

    @property
    def k(self) -> int:
        """ZeRO's optimizer-state multiplier K = master + optimizer bytes (12 for mixed
        precision)."""
        return self.master_bytes + self.optimizer_bytes

    @property
    def state_bytes(self) -> int:
        """All model-state bytes per parameter, unsharded (16 for mixed precision, ZeRO §3.1)."""
        return self.param_bytes + self.grad_bytes + self.k


PRECISIONS = MappingProxyType(
    {
        # ZeRO §3.1 mixed-precision Adam: fp16 params 2 + fp16 grads 2 + fp32 (params, m, v) 12.
        "bf16": Precision("bf16", 2, 2, 4, 8, 2),
        "fp16": Precision("fp16", 2, 2, 4, 8, 2),
        # Pure fp32: the parameters are the master copy, so K = 8 (momentum + variance only).
        "fp32": Precision("fp32", 4, 4, 0, 8, 4),
    }
)


ENGINE_PRECISIONS = MappingProxyType(
    {
        # ZeroEngine: 16-bit params 2 + fp32 accumulated grads 4 + fp32 master 4 + Adam 8.
        "bf16": Precision("bf16", 2, 4, 4, 8, 2, "engine"),
        "fp16": Precision("fp16", 2, 4, 4, 8, 2, "engine"),
        # fp32 params are a copy of the fp32 master (the optimizer updates the master only).
        "fp32": Precision("fp32", 4, 4, 4, 8, 4, "engine"),
    }
)
ACCOUNTINGS = ("paper", "engine")
"""Model-state bookkeeping: ZeRO §3.1 (``PRECISIONS``) or our engine's (``ENGINE_PRECISIONS``)."""


def get_precision(precision: str | Precision, accounting: str = "paper") -> Precision:
    """Look up a precision by name ('bf16', 'fp16', 'fp32') in one of ``ACCOUNTINGS``.

    A ``Precision`` passes through unchanged. Raises ValueError for an unknown name or accounting.
    """
    if isinstance(precision, Precision):
        return precision
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    table = PRECISIONS if accounting == "paper" else ENGINE_PRECISIONS
    try:
        return table[precision]
    except KeyError:
        raise ValueError(
            f"precision must be one of {sorted(table)}, got {precision!r}"
        ) from None
