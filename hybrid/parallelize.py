"""The one composition of the parallelisms: plain GPT -> TP plan -> activation checkpointing ->
ZeRO.

Every place that trains a parallel model (the pretraining job, the planner-vs-engine check,
the benchmark scripts, the test worlds) builds it with :func:`parallelize`, so the order of
the three steps (tensor-parallel module swap, then checkpoint wrapping of the TP blocks, then
ZeRO's flat buffers over the final parameters) is written down exactly once.

The run-time doors of the plain model (each named with ``# door:`` where it opens in
:mod:`models.gpt` / :mod:`models.blocks`), in the order they are installed:

1. Module swaps by the TP plan (:func:`hybrid.parallel.tp_plan.parallelize_gpt`, a table of
   name pattern -> style): ``wte`` vocab-parallel, ``layers.*.attn.qkv`` / ``mlp.gate`` /
   ``mlp.fc1`` column-parallel, ``attn.proj`` / ``mlp.fc2`` row-parallel, ``attn.q_norm`` /
   ``k_norm`` TP-summed, ``attn.attn_dropout`` on the TP stream, ``output_layer`` and
   ``loss_fn`` vocab-parallel; under sequence parallelism also ``wpe``, ``ln1``/``ln2``/``ln_f``
   and ``drop``/``drop1``/``drop2``.
2. Kernel fusion (:func:`hybrid.fusion.apply_kernel_fusion`, per ``config.fusion``): each
   ``Block``/``Attention``/``MLP``/norm's ``fusion`` attribute
   (:class:`models.fusion.KernelFusion`, a plain attribute the model reads, off by default)
   selects its compiled elementwise regions; on CUDA with apex, each norm's ``fused_kernel``
   is apex's (the norm keeps its module and arithmetic).
3. Instance attributes set by activation checkpointing
   (:func:`hybrid.activation.apply.apply_activation_checkpointing`): ``Attention.core``
   replaced by :class:`hybrid.activation.selective.SelectiveCore` (selective recompute), then
   ``Block.forward`` replaced by ``CheckpointedForward`` (full recompute, P_a, CPU offload).
4. PyTorch hooks installed by the ZeRO engine (:class:`hybrid.zero.engine.ZeroEngine`): every
   parameter's ``register_post_accumulate_grad_hook`` (gradient reduce, ``hybrid.zero.reduce``);
   at stage 3 forward pre/post hooks on ``GPT`` and each ``Block`` and tensor hooks in backward
   (gather and free, ``hybrid.zero.stage3``).
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
        (``config.fusion``, :mod:`hybrid.fusion`).

    Raises:
        ValueError: tp does not divide the heads or the MLP width, or the activation options do
            not fit the model (e.g. ``--recompute-num-layers`` > layers).
    """
    from hybrid.activation.apply import apply_activation_checkpointing
    from hybrid.parallel.rng import RNGTracker
    from hybrid.parallel.tp_plan import parallelize_gpt
    from hybrid.parallel.tp_weights import seeded_weights
    from hybrid.zero.engine import ZeroEngine

    sp = config.grid.sequence_parallel
    if tracker is None and (model.config.attention_dropout > 0
                            or (sp and model.config.hidden_dropout > 0)):
        tracker = RNGTracker(config.data.seed, grid.tp_rank, grid.device)
    on_meta = any(p.is_meta for p in model.parameters())
    gpt_config = model.config
    parallelize_gpt(model, grid.tp_group, tracker=tracker,
                    make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
                    sequence_parallel=sp, tp_comm_overlap=config.grid.tp_comm_overlap)
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
    """Apply ``config.fusion`` on ``grid.device`` (:mod:`hybrid.fusion`); the note."""
    from hybrid.fusion import apply_kernel_fusion
    from models.fusion import OFF

    # The dry run traces fake tensors, which torch.compile does not take: it runs eager
    fusion = config.fusion.resolve(grid.device)
    if config.dry_run.dry_run_world_size is not None:
        fusion = OFF
    return apply_kernel_fusion(model, fusion, grid.device)


def meta_gpt(gpt_config) -> GPT:
    """A ``models.gpt.GPT`` of ``gpt_config`` on the ``meta`` device (no memory; for
    :func:`parallelize`)."""
    from models.gpt import GPT

    with torch.device("meta"):
        return GPT(gpt_config)
