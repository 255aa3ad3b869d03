"""Configuration of the ZeRO engine and of its AdamW optimizer (one typed dataclass each).

Units: bucket sizes and thresholds are counts of *elements*, never bytes (as in DeepSpeed's
``reduce_bucket_size`` and friends). Validation runs in ``__post_init__`` and raises
``ValueError`` naming the bad field and value, before any process group is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GRAD_REDUCE_OPS = ("reduce_scatter", "all_reduce")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ZeroConfig:
    """ZeRO data parallelism over the grid's data-parallel group (ZeRO paper, §5)."""

    stage: int = 1
    """0: plain data parallel; 1: + fp32 master and Adam moments partitioned; 2: + gradients
    reduce-scattered to their owner during backward; 3: + parameters partitioned and gathered
    per transformer block."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient-reduction bucket (all ranks' chunks together)."""
    allgather_bucket_size: int = 50_000_000
    """Elements per parameter all-gather (all ranks' chunks together)."""
    grad_reduce: str = "reduce_scatter"
    """Stages 1-3, how a gradient bucket reaches its owner: "reduce_scatter" (the ZeRO paper's
    Psi per step) or "all_reduce" of the bucket, each rank keeping the slices it owns (2 Psi:
    twice the bytes, ledger kind ``all_reduce``). On one host with gloo the all-reduce is the
    faster one (gloo's reduce-scatter costs about 1.5x its all-reduce of the same buffer, and
    stage 1 then reduces its full gradient buffer in place, with no staging copies); with NCCL
    keep "reduce_scatter"."""
    overlap_comm: bool = True
    """Launch gradient reductions during backward as buckets fill; False reduces after it."""
    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer local elements than this stay unpartitioned (0: none)."""
    precision: str = "fp32"
    """Parameter / compute dtype: "fp32", "bf16" or "fp16". Master weights, gradient
    accumulation and gradient reduction are always fp32."""
    loss_scale: float | None = None
    """fp16 only: a static loss scale; None means the dynamic scaler below."""
    initial_loss_scale_power: int = 32
    """fp16 dynamic scaler: the first scale is 2**power."""
    loss_scale_window: int = 1000
    """fp16 dynamic scaler: clean steps after the last overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16 dynamic scaler: overflows tolerated (each still skips its step) before halving."""
    min_loss_scale: float = 1.0
    """fp16 dynamic scaler: the scale never goes below this."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of ``precision``."""
        return PRECISIONS[self.precision]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "loss_scale_window",
                     "hysteresis"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ZeroConfig.{name} must be a positive integer, got {v!r}")
        v = self.param_persistence_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"ZeroConfig.param_persistence_threshold must be an integer >= 0, got {v!r}")
        if self.grad_reduce not in GRAD_REDUCE_OPS:
            raise ValueError(f"ZeroConfig.grad_reduce must be one of {GRAD_REDUCE_OPS}, got {self.grad_reduce!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ZeroConfig.precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.loss_scale is not None and not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"ZeroConfig.loss_scale must be a positive finite number or None, got {self.loss_scale!r}")
        if not isinstance(self.initial_loss_scale_power, int) or not 0 <= self.initial_loss_scale_power <= 64:
            raise ValueError("ZeroConfig.initial_loss_scale_power must be an integer in [0, 64], "
                             f"got {self.initial_loss_scale_power!r}")
        if not (self.min_loss_scale > 0 and math.isfinite(self.min_loss_scale)):
            raise ValueError(f"ZeroConfig.min_loss_scale must be positive, got {self.min_loss_scale!r}")


@dataclass
class OptimizerConfig:
    """AdamW (torch.optim.AdamW) with global gradient-norm clipping."""

    lr: float = 1e-4
    """Initial learning rate; ``ZeroEngine.step(lr)`` overrides it every step."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (L2 over every distinct element); 0 disables."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name in ("lr", "weight_decay", "adam_eps", "clip_grad"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"OptimizerConfig.{name} must be a finite number >= 0, got {v!r}")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {v!r}")
