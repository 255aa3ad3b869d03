"""The one composition of the parallelisms: plain GPT -> TP plan -> activation checkpointing ->
ZeRO.

Every place that trains a parallel model (the pretraining job, the planner-vs-engine check,
the benchmark scripts, the test worlds) builds it with :func:`parallelize`, so the order of
the three steps (tensor-parallel module swap, then checkpoint wrapping of the TP blocks, then
ZeRO's flat buffers over the final parameters) is written down exactly once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.zero.engine import ZeroEngine
    from models.gpt import GPT


def parallelize(model: GPT, grid: ProcessGrid, config: PretrainConfig,
                tracker: RNGTracker | None = None) -> ZeroEngine:
    """Make ``model`` tensor-parallel over ``grid.tp_group``, checkpoint its blocks as
    ``config.activation`` asks, and wrap it in a ZeRO engine over ``grid.dp_group``.

    Weights: a ``model`` on the ``meta`` device stays on meta through the TP plan; the engine
    allocates its steady-state buffers and fills them one unit (root, then each block) at a time,
    initialised from ``config.data.seed`` exactly as ``GPT.init_weights(seed)`` would initialise
    the full model (any tp gives the same weights), so no rank ever holds a second full copy. A
    model with real weights is sharded as it is, so the result computes what it computed.

    Args:
        model: a plain ``models.gpt.GPT`` (on ``meta`` or with real fp32 weights).
        grid: the process grid.
        config: uses the ``zero``, ``optimizer`` and ``activation`` sections,
            ``model.make_vocab_size_divisible_by`` and ``data.seed``.
        tracker: the TP-region dropout stream; None creates one from ``config.data.seed`` and
            ``grid.tp_rank`` when the model has attention dropout.

    Returns:
        The :class:`hybrid.zero.engine.ZeroEngine`; ``engine.model`` is the parallel model,
        ``engine.activation_checkpointing`` the
        :class:`hybrid.activation.apply.ActivationCheckpointing` handle (None when off) and
        ``engine.kernel_fusion_note`` one line saying which kernels are fused
        (``config.fusion``, :mod:`hybrid.parallel.kernels`).

    Raises:
        ValueError: tp does not divide the heads or the MLP width, or the activation options do
            not fit the model (e.g. ``--recompute-num-layers`` > layers).
    """
    from hybrid.activation.apply import apply_activation_checkpointing
    from hybrid.parallel.rng import RNGTracker
    from hybrid.parallel.tp_plan import parallelize_gpt, seeded_weights
    from hybrid.zero.engine import ZeroEngine

    sp = config.grid.sequence_parallel
    if tracker is None and (model.config.attention_dropout > 0
                            or (sp and model.config.hidden_dropout > 0)):
        tracker = RNGTracker(config.data.seed, grid.tp_rank, grid.device)
    on_meta = any(p.is_meta for p in model.parameters())
    gpt_config = model.config
    parallelize_gpt(model, grid.tp_group, tracker=tracker,
                    make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
                    sequence_parallel=sp)
    if not on_meta:
        model.to(grid.device)
    engine_note = _fuse_kernels(model, grid, config)
    # A meta model stays on meta: the engine allocates its buffers at their final size and fills
    # them one unit at a time from the seeded source (no second full copy, hybrid.zero.storage).
    weights = seeded_weights(gpt_config, config.data.seed) if on_meta else None
    handle = None
    if config.activation.checkpoint_activations or config.activation.selective_recompute:
        handle = apply_activation_checkpointing(model, grid, config.activation, tracker)
    engine = ZeroEngine(model, grid, config.zero, config.optimizer, weights=weights)
    engine.activation_checkpointing = handle
    engine.kernel_fusion_note = engine_note
    return engine


def _fuse_kernels(model, grid: ProcessGrid, config: PretrainConfig) -> str:
    """Apply ``config.fusion`` on ``grid.device`` (:mod:`hybrid.parallel.kernels`); the note."""
    from hybrid.parallel.kernels import apply_kernel_fusion
    from models.fusion import OFF

    # The dry run traces fake tensors, which torch.compile does not take: it runs eager
    fusion = config.fusion.resolve(grid.device)
    if config.grid.dry_run_world_size is not None:
        fusion = OFF
    return apply_kernel_fusion(model, fusion, grid.device)


def meta_gpt(gpt_config) -> GPT:
    """A ``models.gpt.GPT`` of ``gpt_config`` on the ``meta`` device (no memory; for
    :func:`parallelize`)."""
    from models.gpt import GPT

    with torch.device("meta"):
        return GPT(gpt_config)
