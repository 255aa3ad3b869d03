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

It also moves weights between the full (single-process) and the sharded form:
:func:`load_full_state_dict`, :func:`gather_full_state_dict`; checkpoint resharding uses both.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.parallel.grad_groups import group_tp_summed_grads
from hybrid.parallel.ops import TPLedger
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.sequence import TP_COMM_OVERLAP_NEEDS_SP, sequence_parallel_active
from hybrid.parallel.tp_spec import TPSpec, get_tp_spec, set_tp_spec
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.parallel.tp_styles import STYLES, Swap
from hybrid.parallel.vocab import pad_vocab_size
from models.gpt import GPT, draws_normal, init_parameter, parameter_generator

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


def _fill_weights(model: GPT, tp_group, full: dict | None, seed: int | None,
                  device: torch.device) -> None:
    """Give every remaining parameter a replicated ``tp_spec``, then shard ``full`` into the
    model or initialise it from ``seed`` (a meta model stays meta with neither)."""
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    for p in model.parameters():
        if getattr(p, "tp_spec", None) is None:
            set_tp_spec(p, TPSpec(None, tuple(p.shape), 0, rank, tp))
    if full is not None:
        load_full_state_dict(model, full)
    elif seed is not None:
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)
        init_sharded(model, seed)


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
    _fill_weights(model, tp_group, full, seed, swap.device)
    return model


def tp_ledger(model: nn.Module) -> TPLedger | None:
    """The :class:`hybrid.parallel.ops.TPLedger` of a model made by :func:`parallelize_gpt`."""
    return next((m.ledger for m in model.modules()
                 if isinstance(getattr(m, "ledger", None), TPLedger)), None)


@torch.no_grad()
def init_sharded(model: GPT, seed: int) -> None:
    """Initialise each local shard as the matching slice of ``GPT.init_weights(seed)``.

    Materialises one full parameter at a time on CPU (the largest is the embedding).
    """
    weights = seeded_weights(model.config, seed)
    for name, p in model.named_parameters():
        p.copy_(weights(name, p))


# Elements drawn at once when a seeded shard is drawn row block by row block (16M fp32 = 64 MiB).
SEED_CHUNK_ELEMENTS = 1 << 24


def seeded_shard(name: str, spec: TPSpec, config, seed: int,
                 chunk_elements: int = SEED_CHUNK_ELEMENTS) -> torch.Tensor:
    """This TP rank's (zero-padded) shard of parameter ``name`` exactly as
    ``GPT.init_weights(seed)`` draws the full parameter, holding one block of rows at a time.

    The full ``[rows, cols]`` weight is drawn from its own generator in consecutive blocks of a
    multiple of 16 rows (at most ``chunk_elements`` elements, except that a block is at least
    16 rows); each block keeps the part of this rank's shard it holds, and drawing stops after
    the shard's last row. Torch's CPU ``normal_`` draws one uniform per element in order and
    transforms aligned groups of 16 (Box-Muller; a tensor whose size is not a multiple of 16
    redraws its last 16), so blocks that start on a multiple of 16 elements and a last block of
    at least 16 elements give exactly the values of one full draw (checked for every shape
    kind by ``tests/test_tp_seeded_init.py``). Peak: one block plus the shard, instead of the
    full parameter (1.6 GB for the 100B model's embedding at tp 8).

    Args:
        name: parameter name in the plain GPT (decides the init, as ``init_parameter``).
        spec: the parameter's :class:`TPSpec` on this rank.
        config: the ``GPTConfig``.
        seed: the job seed of ``GPT.init_weights(seed)``.
        chunk_elements: elements per block (tests make it small).

    Returns:
        fp32 CPU tensor of this rank's local (padded) shape.
    """
    full_shape = spec.full_shape
    numel = math.prod(full_shape)
    if spec.replicated or not draws_normal(name) or len(full_shape) != 2 or numel < 32:
        full = torch.empty(full_shape)
        init_parameter(name, full, config, parameter_generator(seed, name))
        return spec.shard(full)
    rows, cols = full_shape
    start, stop = spec.local_range()
    real = spec.real_local_size()
    shape = list(full_shape)
    shape[spec.split_dim] = stop - start
    out = torch.zeros(shape)
    block = max(16, chunk_elements // cols // 16 * 16)
    bounds = list(range(0, rows, block)) + [rows]
    if len(bounds) > 2 and (rows - bounds[-2]) * cols < 16:  # a last block under 16 elements
        bounds.pop(-2)                                     # draws differently: merge it
    last_row = start + real if spec.split_dim == 0 else rows
    gen = parameter_generator(seed, name)
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):
        if r0 >= last_row:
            break
        part = torch.empty(r1 - r0, cols)
        init_parameter(name, part, config, gen)
        if spec.split_dim == 1:
            out[r0:r1, :real] = part[:, start:start + real]
        else:
            lo, hi = max(r0, start), min(r1, start + real)
            if lo < hi:
                out[lo - start:hi - start] = part[lo - r0:hi - r0]
    return out


def seeded_weights(config, seed: int):
    """A weight source (:mod:`hybrid.zero.storage`): ``(name, param) -> `` this TP rank's shard
    of parameter ``name`` exactly as ``GPT.init_weights(seed)`` initialises the full model
    (fp32, on CPU; drawn block by block, :func:`seeded_shard`)."""
    def source(name: str, param: torch.Tensor) -> torch.Tensor:
        return seeded_shard(name, get_tp_spec(param), config, seed)

    return source


def full_weights(state_dict: dict[str, torch.Tensor]):
    """A weight source slicing this TP rank's shard out of full (single-process) tensors.

    Raises (when called):
        KeyError: the name is missing from ``state_dict``.
        ValueError: the full tensor's shape differs from ``param.tp_spec.full_shape``.
    """
    def source(name: str, param: torch.Tensor) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"{name} is missing from the weights (have {len(state_dict)} tensors)")
        try:
            return get_tp_spec(param).shard(state_dict[name].float())
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    return source


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded, unpadded) tensors into ``model``'s local shards.

    Raises:
        KeyError: a parameter of ``model`` is missing from ``state_dict``, or the dict has keys
            the model does not know (both listed).
        ValueError: a tensor's shape differs from the parameter's full shape.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        spec = get_tp_spec(p)
        try:
            p.copy_(spec.shard(state_dict[name].to(p.device, p.dtype)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


@torch.no_grad()
def gather_full_tensor(local: torch.Tensor, spec: TPSpec, group) -> torch.Tensor:
    """All-gather a sharded tensor over the TP group and drop its padding -> ``spec.full_shape``."""
    if spec.replicated or spec.tp_size == 1:
        return local.detach().clone() if spec.replicated else local.detach().narrow(
            spec.split_dim, 0, spec.full_shape[spec.split_dim]).clone()
    parts = [torch.empty_like(local) for _ in range(spec.tp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=spec.split_dim).narrow(
        spec.split_dim, 0, spec.full_shape[spec.split_dim]).clone()


def gather_full_state_dict(model: nn.Module, tp_group,
                           tensors: dict[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor]:
    """The full (single-process) state dict of a TP model, identical on every TP rank.

    Args:
        model: a model made by :func:`parallelize_gpt`.
        tp_group: its tensor-parallel group.
        tensors: optional per-parameter local tensors to gather instead of the parameters
            themselves (e.g. their ``.grad``), keyed like ``model.named_parameters()``.

    Returns:
        ``{name: tensor of spec.full_shape}`` on the parameters' device.
    """
    out = {}
    for name, p in model.named_parameters():
        local = p if tensors is None else tensors[name]
        out[name] = gather_full_tensor(local, get_tp_spec(p), tp_group)
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(sharded, replicated)``: real (unpadded) elements of this rank's split parameters, and
    elements of its replicated ones. Summing ``sharded`` over TP ranks and adding ``replicated``
    once gives the single-process count."""
    sharded = replicated = 0
    for p in model.parameters():
        spec = get_tp_spec(p)
        if spec.replicated:
            replicated += p.numel()
        else:
            sharded += spec.real_numel()
    return sharded, replicated
