"""What a ZeRO stage partitions and how it reduces, decided once (arXiv 1910.02054 §5.1-5.3).

:func:`stage_plan` is the one place that turns a stage number (and the gradient collective)
into booleans. The engine derives its :class:`StagePlan` once from its
:class:`hybrid.zero.config.ZeroConfig` (``ZeroConfig.plan``); storage, the gradient reducer,
the parameter refresh, the state export, the dry run and the planner's memory model read it
instead of comparing stage numbers.

    =====  ==================  ===============  ================  ===========================
    stage  master + Adam (os)  gradients (g)    parameters (p)    gradients reduced
    =====  ==================  ===============  ================  ===========================
    0      whole               whole            whole             last micro-batch, in place
    1      partitioned         whole            whole             last micro-batch
    2      partitioned         partitioned      whole             every micro-batch
    3      partitioned         partitioned      partitioned       every micro-batch
    =====  ==================  ===============  ================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages (arXiv 1910.02054 §5.1-5.3): 0 plain data parallel, 1 P_os, 2 P_os+g, 3 P_os+g+p."""

GRAD_REDUCE_OPS = ("reduce_scatter", "all_reduce")
"""How a ZeRO 1-3 gradient bucket reaches its owner (``ZeroConfig.grad_reduce``)."""


@dataclass(frozen=True)
class StagePlan:
    """What one ZeRO stage keeps partitioned over the data-parallel group, and how it reduces."""

    stage: int
    """The ZeRO stage, 0-3."""
    shards_optimizer_states: bool
    """P_os (§5.1, stage >= 1): the fp32 master and the Adam moments are partitioned over dp."""
    shards_gradients: bool
    """P_g (§5.2, stage >= 2): a rank keeps only its partition of the fp32 gradient."""
    shards_parameters: bool
    """P_p (§5.3, stage 3): compute-dtype parameters are partitioned, gathered per unit."""
    persistence_threshold: int
    """Parameters with fewer local elements than this stay whole (elements; 0 below stage 3:
    nothing is partitioned, so nothing is persistent)."""
    reduce_every_micro_batch: bool
    """Gradients are reduced during every micro-batch's backward (stages 2-3: a partitioned
    gradient cannot accumulate unreduced); otherwise during the last micro-batch's only."""
    grad_all_reduce: bool
    """Gradient buckets are all-reduced (stage 0, or ``grad_reduce="all_reduce"``) rather than
    reduce-scattered."""
    grad_in_place: bool
    """The full flat fp32 gradient is all-reduced in place, without staging buffers (stage 0,
    and stage 1 by all-reduce)."""


def stage_plan(stage: int, grad_reduce: str = "reduce_scatter",
               param_persistence_threshold: int = 0) -> StagePlan:
    """The plan of ZeRO stage ``stage`` with gradient collective ``grad_reduce``.

    Args:
        stage: 0-3 (:data:`ZERO_STAGES`).
        grad_reduce: one of :data:`GRAD_REDUCE_OPS` (ignored at stage 0, which all-reduces).
        param_persistence_threshold: elements; applies at stage 3 only.

    Raises:
        ValueError: ``stage`` or ``grad_reduce`` is not one of the known values.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if grad_reduce not in GRAD_REDUCE_OPS:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_OPS}, got {grad_reduce!r}")
    os_, g, p = stage >= 1, stage >= 2, stage >= 3
    all_reduce = not os_ or grad_reduce == "all_reduce"
    return StagePlan(
        stage=stage, shards_optimizer_states=os_, shards_gradients=g, shards_parameters=p,
        persistence_threshold=param_persistence_threshold if p else 0,
        reduce_every_micro_batch=g, grad_all_reduce=all_reduce,
        grad_in_place=not os_ or (not g and all_reduce))
