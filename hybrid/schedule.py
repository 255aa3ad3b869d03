"""Learning-rate schedule: linear warmup, then constant / linear / cosine decay to ``min_lr``.

Indexed by the number of *successful* optimizer steps so far, so steps skipped for fp16
overflow or a NaN loss do not advance it (as in Megatron-LM's OptimizerParamScheduler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step)`` for 0-based successful-step index ``step``.

    Warmup: ``lr * (step + 1) / warmup_iters`` for ``step < warmup_iters`` (the first step
    already trains). Decay over ``[warmup_iters, decay_iters)``: constant keeps ``lr``, linear
    goes straight to ``min_lr``, cosine follows ``min + (lr - min) * (1 + cos(pi * t)) / 2``.
    From ``decay_iters`` on: ``min_lr`` (``lr`` for constant).

    Raises:
        ValueError: an unknown style, or ``warmup_iters > decay_iters``.
    """

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def __post_init__(self):
        if self.style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.style!r}: valid styles are {DECAY_STYLES}")
        if not 0 <= self.warmup_iters <= self.decay_iters:
            raise ValueError(f"need 0 <= warmup_iters {self.warmup_iters} <= decay_iters "
                             f"{self.decay_iters}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        t = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            return self.lr - (self.lr - self.min_lr) * t
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
