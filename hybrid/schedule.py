"""Learning-rate and weight-decay schedules, step for step those of Megatron-LM's
``OptimizerParamScheduler``.

Both are functions of ``n``, the number of training *samples* consumed by the optimizer steps
that updated the weights so far (Megatron-LM advances its scheduler by the global batch size
after each successful update only, so a step skipped for fp16 overflow or a NaN loss does not move
it). Iteration ``i`` (1-based) therefore trains at ``lr(n_{i-1})``: the first at
``--lr-warmup-init``. With a fixed global batch ``B``, ``n = B x successful steps`` and the
iteration counts of the flags are multiplied by ``B`` (``--lr-warmup-iters W`` is ``W x B``
samples), so every ratio is that of the iteration counts.

Formulas (warmup: linear from ``init_lr`` to ``lr`` over ``warmup_steps``; cosine: the SGDR
annealing of arXiv:1608.03983 Eq. 5; inverse square root: arXiv:1706.03762 Section 5.3; WSD,
warmup-stable-decay: arXiv:2404.06395 Section 4.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _anneal(style: str, ratio: float) -> float:
    """The decay coefficient in [0, 1] at ``ratio`` in [0, 1] of the way (1 at 0, 0 at 1)."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"decay style {style!r}: valid styles are {DECAY_STYLES + WSD_DECAY_STYLES}")


@dataclass(frozen=True)
class LRSchedule:
    """``lr(n)`` after ``n`` samples of successful steps (all lengths in the same unit as ``n``).

    * ``n <= warmup_steps`` (when ``warmup_steps > 0``): ``init_lr + (lr - init_lr) n / warmup``;
    * ``constant``: ``lr``; past ``decay_steps``: ``min_lr``;
    * ``inverse-square-root``: ``max(min_lr, lr sqrt(max(warmup, 1)) / sqrt(max(n, 1)))``;
    * else ``min_lr + (lr - min_lr) c(r)`` with ``r = (n - warmup) / (decay - warmup)`` and ``c``
      linear ``1 - r`` or cosine ``(1 + cos(pi r)) / 2``; ``WSD`` holds ``c = 1`` until the last
      ``wsd_decay_steps`` of the decay and anneals over those with ``wsd_style`` (exponential
      ``2 * 0.5^r - 1``, linear, cosine or minus_sqrt ``1 - sqrt(r)``).

    Raises:
        ValueError: an unknown style, ``min_lr > lr``, ``init_lr > lr``, ``decay_steps <= 0``,
            ``warmup_steps >= decay_steps`` or WSD without ``wsd_decay_steps`` (Megatron-LM's
            assertions).
    """

    lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: int
    style: str = "linear"
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_style: str = "exponential"

    def __post_init__(self):
        if self.style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.style!r}: valid styles are {DECAY_STYLES}")
        if self.wsd_style not in WSD_DECAY_STYLES:
            raise ValueError(f"WSD decay style {self.wsd_style!r}: valid styles are "
                             f"{WSD_DECAY_STYLES}")
        if not 0 <= self.min_lr <= self.lr or self.init_lr > self.lr:
            raise ValueError(f"need 0 <= min lr {self.min_lr} <= lr {self.lr} and warmup init "
                             f"{self.init_lr} <= lr")
        if not 0 <= self.warmup_steps < self.decay_steps:
            raise ValueError(f"need 0 <= warmup steps {self.warmup_steps} < decay steps "
                             f"{self.decay_steps}")
        if self.style == "WSD" and self.wsd_decay_steps is None:
            raise ValueError("the WSD style needs its decay length (--lr-wsd-decay-iters)")

    def __call__(self, n: float) -> float:
        w, d = self.warmup_steps, self.decay_steps
        if w > 0 and n <= w:
            return self.init_lr + (self.lr - self.init_lr) * float(n) / float(w)
        if self.style == "constant":
            return self.lr
        if n > d:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.lr * max(w, 1) ** 0.5 / max(n, 1) ** 0.5)
        if self.style == "WSD":
            start = d - self.wsd_decay_steps
            coeff = 1.0 if n <= start else _anneal(self.wsd_style,
                                                   float(n - start) / float(self.wsd_decay_steps))
        else:
            coeff = _anneal(self.style, float(n - w) / float(d - w))
        return self.min_lr + coeff * (self.lr - self.min_lr)


@dataclass(frozen=True)
class WeightDecaySchedule:
    """``weight_decay(n)`` of the decayed parameters after ``n`` samples of successful steps:
    ``start + c (end - start)`` with ``c`` = ``n / incr_steps`` (linear) or
    ``(cos(pi (1 - n / incr_steps)) + 1) / 2`` (cosine); ``end`` for constant and past
    ``incr_steps``.

    Raises:
        ValueError: an unknown style, ``start > end``, a negative start, or constant with
            ``start != end``.
    """

    start: float
    end: float
    incr_steps: int
    style: str = "constant"

    def __post_init__(self):
        if self.style not in WD_INCR_STYLES:
            raise ValueError(f"weight decay increment style {self.style!r}: valid styles are "
                             f"{WD_INCR_STYLES}")
        if not 0 <= self.start <= self.end or (self.style == "constant"
                                                and self.start != self.end):
            raise ValueError(f"need 0 <= start weight decay {self.start} <= end {self.end}, equal "
                             "for the constant style")

    def __call__(self, n: float) -> float:
        if n > self.incr_steps or self.style == "constant":
            return self.end
        ratio = float(n) / float(self.incr_steps)
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        return self.start + coeff * (self.end - self.start)


@dataclass(frozen=True)
class ParamSchedule:
    """The learning rate and weight decay of each step: ``schedule(n) -> (lr, weight_decay)``;
    ``decoupled_lr(n)``: that of the embedding and output layer (Megatron-LM's
    ``--decoupled-lr``: the same warmup and decay between its own peak and minimum), None
    without one."""

    lr: LRSchedule
    weight_decay: WeightDecaySchedule
    decoupled: LRSchedule | None = None

    def decoupled_lr(self, n: float) -> float | None:
        return None if self.decoupled is None else self.decoupled(n)

    def __call__(self, n: float) -> tuple[float, float]:
        return self.lr(n), self.weight_decay(n)
