"""The tensor-parallel plan: turns a plain ``models.gpt.GPT`` into its TP form, in place.

The plan maps module-name patterns to parallel styles (arXiv 1909.08053 §3), each a callable of
:data:`hybrid.parallel.tp_styles.STYLES`::

    wte                      -> VocabParallelEmbedding (vocabulary padded, rows split)
    lm_head (untied only)    -> vocabulary-split output weight
    layers.*.attn.qkv        -> ColumnParallelLinear  (query groups split: whole K/V heads and
                                                     their query heads per rank; G % tp == 0)
    layers.*.attn.proj       -> RowParallelLinear
    layers.*.mlp.gate, fc1   -> ColumnParallelLinear  (SwiGLU: each rank holds the matching
                                                     rows of gate and up)
    layers.*.mlp.fc2         -> RowParallelLinear
    layers.*.attn.q_norm, k_norm -> SequenceParallelLayerNorm (replicated weight, TP-summed
                                gradient: each rank normalises other heads; qk_layernorm only)
    layers.*.attn.attn_dropout -> TPRegionDropout (per-TP-rank RNG stream)
    output_layer             -> ParallelOutputLayer (local logits)
    loss_fn                  -> VocabParallelLoss
    everything else (LayerNorms, positions, biases of row-parallel layers) is replicated.

With ``sequence_parallel`` (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2) the same layers
take their sequence-parallel form (see :mod:`hybrid.parallel.layers` and
:mod:`hybrid.parallel.linear`) and these are added::

    wpe                      -> SequenceParallelPositionEmbedding (this rank's s/t positions)
    layers.*.ln1, ln2, ln_f  -> SequenceParallelLayerNorm (TP-summed weight/bias gradients)
    drop, layers.*.drop1, layers.*.drop2 -> TPRegionDropout (each rank's slice is other data)

The TP-summed gradients of each block's replicated parameters (and of the rest of the model's)
are summed in one all-reduce per block (:mod:`hybrid.parallel.grad_groups`).

The MLP's linears are ``token_wise``: under sequence parallelism the tokens between its gather
and its reduce-scatter stay in the collectives' rank-major order (the MLP treats each token
alike), so a micro-batch > 1 needs no reordering copy there (``hybrid.parallel.ops``).

Parameters keep their names, shapes and ``tp_spec`` (replicated stays replicated), so weights
and checkpoints are the same with and without sequence parallelism.

The weights of the swapped modules (sharded from a full state dict, or drawn from the seed as
the single-process model draws them) are :mod:`hybrid.parallel.tp_weights`'.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.parallel.grad_groups import group_tp_summed_grads
from hybrid.parallel.ops import TPLedger
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.sequence import TP_COMM_OVERLAP_NEEDS_SP, sequence_parallel_active
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.parallel.tp_styles import STYLES, Swap
from hybrid.parallel.tp_weights import fill_weights
from hybrid.parallel.vocab import pad_vocab_size
from models.gpt import GPT

GPT_TP_PLAN: dict[str, str] = {
    "wte": "vocab_embedding",
    "lm_head": "vocab_output",
    "layers.*.attn.qkv": "column",
    "layers.*.attn.proj": "row",
    "layers.*.mlp.gate": "column_token_wise",
    "layers.*.mlp.fc1": "column_token_wise",
    "layers.*.attn.q_norm": "tp_summed_norm",
    "layers.*.attn.k_norm": "tp_summed_norm",
    "layers.*.mlp.fc2": "row_token_wise",
    "layers.*.attn.attn_dropout": "tp_dropout",
    "output_layer": "parallel_output",
    "loss_fn": "vocab_parallel_loss",
}
SEQUENCE_PARALLEL_PLAN: dict[str, str] = {
    "wpe": "sp_positions",
    "layers.*.ln1": "sp_layernorm",
    "layers.*.ln2": "sp_layernorm",
    "ln_f": "sp_layernorm",
    "drop": "tp_dropout",
    "layers.*.drop1": "tp_dropout",
    "layers.*.drop2": "tp_dropout",
}


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _check_fits(cfg, tp: int, sequence_parallel: bool, tracker: RNGTracker | None) -> None:
    """Raises ValueError: tp does not divide heads / K/V groups / MLP width; TP-region dropout
    without a tracker."""
    if (refusal := tp_split_refusal(cfg, tp)) is not None:
        raise ValueError(refusal.layer_message())
    dropout_in_tp_region = (cfg.attention_dropout > 0
                            or sequence_parallel and cfg.hidden_dropout > 0)
    if dropout_in_tp_region and tracker is None:
        raise ValueError("attention_dropout > 0 (or hidden_dropout > 0 with sequence parallelism) "
                         "needs an RNGTracker for the TP-region dropout")


def _target(model: GPT, full: dict | None, seed: int | None) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the TP modules: meta stays meta unless ``seed`` materialises it on
    CPU; real weights keep their device."""
    some = next(model.parameters())
    device = torch.device("meta") if full is None and seed is None else (
        some.device if full is not None else torch.device("cpu"))
    return device, some.dtype


def parallelize_gpt(
    model: GPT,
    tp_group,
    tracker: RNGTracker | None = None,
    make_vocab_size_divisible_by: int = 128,
    seed: int | None = None,
    sequence_parallel: bool = False,
    ledger: TPLedger | None = None,
    tp_comm_overlap: bool = False,
) -> GPT:
    """Swap ``model``'s modules for their tensor-parallel forms over ``tp_group``, in place.

    Weights: if ``model`` holds real weights they are sharded (so TP equals the model it came
    from); if it lives on the ``meta`` device the TP model stays on meta unless ``seed`` is
    given, in which case it is materialised on CPU and initialised shard by shard exactly as
    ``GPT.init_weights(seed)`` would initialise the full model.

    Args:
        model: a plain GPT (tp must divide ``num_attention_heads`` and ``ffn_hidden_size``).
        tp_group: the tensor-parallel process group (``grid.tp_group``).
        tracker: RNG tracker for dropout inside TP regions; required when attention dropout > 0.
        make_vocab_size_divisible_by: vocabulary padding unit per TP rank.
        seed: initialise a meta model shard by shard from this seed.
        sequence_parallel: shard the LayerNorm / dropout regions along the sequence
            (``--sequence-parallel``; no effect at tp = 1, as in Megatron-LM).
        ledger: counts the TP collectives' bytes (a new one when None; :func:`tp_ledger`).
        tp_comm_overlap: pipeline the blocks' SP all-gathers and reduce-scatters with their
            GEMMs (``--tp-comm-overlap``, :mod:`hybrid.parallel.linear.collective_matmul`).

    Returns:
        The same ``model`` object, now tensor-parallel. Every parameter carries a ``tp_spec``.

    Raises:
        ValueError: tp does not divide the head count or the MLP width; dropout without tracker;
            ``tp_comm_overlap`` without sequence parallelism at tp > 1.
    """
    cfg = model.config
    tp = dist.get_world_size(tp_group)
    sequence_parallel = sequence_parallel_active(sequence_parallel, tp)
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError(f"tp_comm_overlap {TP_COMM_OVERLAP_NEEDS_SP} (sequence_parallel in "
                         f"effect: {sequence_parallel}, tp {tp})")
    _check_fits(cfg, tp, sequence_parallel, tracker)
    full = None if any(p.is_meta for p in model.parameters()) else {
        k: v.detach().clone() for k, v in model.state_dict().items()
    }
    swap = Swap(model, tp_group, tracker,
                 pad_vocab_size(cfg.vocab_size, tp, make_vocab_size_divisible_by),
                 TPLedger() if ledger is None else ledger, sequence_parallel,
                 *_target(model, full, seed), tp_comm_overlap)
    plan = dict(GPT_TP_PLAN, **(SEQUENCE_PARALLEL_PLAN if sequence_parallel else {}))
    for name, module in list(model.named_modules()):
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is not None and module is not None:
            _set_submodule(model, name, STYLES[style](module, swap))
    if tp > 1:
        group_tp_summed_grads(model, tp_group, swap.ledger)
    fill_weights(model, tp_group, full, seed, swap.device)
    return model


def tp_ledger(model: nn.Module) -> TPLedger | None:
    """The :class:`hybrid.parallel.ops.TPLedger` of a model made by :func:`parallelize_gpt`."""
    return next((m.ledger for m in model.modules()
                 if isinstance(getattr(m, "ledger", None), TPLedger)), None)


