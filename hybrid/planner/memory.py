"""Per-rank GPU memory of training state: ZeRO model states, activations and comm buffers.

All results are bytes per rank (one GPU), with GB = 1e9 bytes as in the ZeRO paper.
Layout assumed everywhere: the tensor-parallel shard is taken first, then ZeRO shards each TP
rank's parameters within its data-parallel group (ZeRO 1910.02054 §1 "ZeRO and MP": reduction
N_d x N_m).

Sources:
- Model states: ZeRO §3.1 (2 + 2 + K bytes/param, K = 12) and §5.1-5.3 (P_os, P_os+g, P_os+g+p).

Two accountings of the model states (``get_precision(name, accounting)``), same sharding rules
(``hybrid.zero.stage.stage_plan``: stage >= 1 shards master + Adam, >= 2 also gradients, 3 also
parameters):

    =========  ===================  =================================  ==========================
    accounting precision            params  grads  master  Adam (B/param, unsharded)   sum
    =========  ===================  =================================  ==========================
    paper      bf16 / fp16          2       2      4       8                            16
    paper      fp32                 4       4      0       8                            16
    engine     bf16 / fp16          2       4      4       8                            18
    engine     fp32                 4       4      4       8                            20
    =========  ===================  =================================  ==========================

``paper`` is ZeRO §3.1 and reproduces the paper's tables. ``engine`` is what
``hybrid.zero.engine.ZeroEngine`` holds (its ``memory_bytes()``): gradients accumulate and are
reduced in fp32 (4 B), and the fp32 master is a separate copy even in fp32 training. In both,
gradients travel at ``grad_bytes`` and gathered parameters at ``param_bytes``
(``hybrid.planner.traffic``).
- Activations: Korthikanti et al. 2022 (2205.05198) §4.1 and Table 2; checkpoints and P_a:
  ZeRO §4.2, §6.1, §8; the 12hbsL rule of thumb: ZeRO §3.2 footnote.
- Constant-size buffers C_B: ZeRO §6.2 (no size given; our defaults are in ``hybrid.planner.plan``).
"""

from __future__ import annotations

import math

from hybrid.flops import parameters_per_tp_rank
from hybrid.planner.activations import layer_activation_bytes as layer_activation_bytes
from hybrid.planner.activations import layer_saved_terms as layer_saved_terms
from hybrid.planner.precision import Precision, get_precision
from hybrid.zero.stage import ZERO_STAGES as ZERO_STAGES  # re-exported for the planner
from hybrid.zero.stage import stage_plan
from models.config import GPTConfig

ACTIVATION_OPTIONS = ("none", "full", "full+pa", "full+pa+cpu", "selective", "sp", "sp+selective",
                      "full+sp", "full+sp+cpu")
"""No checkpointing; one checkpoint per layer; checkpoints partitioned over TP (P_a);
partitioned checkpoints offloaded to CPU (P_a+cpu); selective recompute of the attention core;
sequence parallelism (``sp``, 2205.05198 §4.2.2) alone, with selective recompute, with full
recompute (its checkpoints are already 1/t: P_a adds nothing) and with the checkpoints on CPU."""
LAYER_RECOMPUTE = ("none", "selective", "full")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def params_per_tp_rank(model_or_params: object, tp: int) -> int:
    """Parameters one TP rank holds (elements) before ZeRO sharding.

    A number is the whole model's Ψ, taken as perfectly TP-sharded (ceil(Ψ / tp)), which is how
    the ZeRO paper counts; a config-like object is counted exactly, with replicated LayerNorms,
    row-parallel biases and position embeddings (``flops.parameters_per_tp_rank``).
    """
    _check_positive(tp=tp)
    if isinstance(model_or_params, (int, float)) and not isinstance(model_or_params, bool):
        _check_positive(num_params=model_or_params)
        return math.ceil(model_or_params / tp)
    return parameters_per_tp_rank(model_or_params, tp)


def persistent_parameters(model: GPTConfig, tp: int, threshold: int) -> int:
    """Elements of one TP rank's parameters that ZeRO stage 3 keeps whole (never partitioned).

    ``ZeroConfig.param_persistence_threshold``: every local parameter tensor with fewer than
    ``threshold`` elements (LayerNorms and biases at real sizes; everything in a toy model).
    Local sizes per layer: qkv [(a+2G)d/t, h] + [(a+2G)d/t], proj [h, ad/t] + [h], fc1 (and
    SwiGLU's gate) [f/t, h] + [f/t], fc2 [h, f/t] + [h], two norms 2 x [h] (+ 2 x [h] biases for
    LayerNorm), q/k norms [d]; biases only as the model has them; outside: wte [V/t, h], wpe
    [s, h] (learned positions), ln_f [h] (+ [h]), untied head [V/t, h]. ``model`` must have a
    TP-padded vocabulary (``hybrid.parallel.vocab.pad_vocab_size``).
    """
    m = model
    if threshold <= 0:
        return 0
    _check_positive(tp=tp)
    h, f, v, qkv = m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.qkv_size
    ad = m.num_attention_heads * m.head_dim
    bias, rms = m.add_bias_linear, m.normalization == "RMSNorm"
    layer = [qkv * h // tp, ad * h // tp] + [f * h // tp] * (3 if m.swiglu else 2)
    layer += [qkv // tp] if bias or m.add_qkv_bias else []
    layer += [h, h] + [f // tp] * (2 if m.swiglu else 1) if bias else []
    norm = [1] if rms else [1, 1]
    layer += [h] * 2 * len(norm) + ([m.head_dim] * 2 * len(norm) if m.qk_layernorm else [])
    outside = [v * h // tp]
    outside += [m.max_position_embeddings * h] if m.position_embedding_type == "learned_absolute" \
        else []
    outside += [h] * len(norm)
    outside += [v * h // tp] if m.untie_embeddings_and_output_weights else []
    small = m.num_layers * sum(n for n in layer if n < threshold)
    return small + sum(n for n in outside if n < threshold)


def model_state_bytes(
    model_or_params: object,
    tp: int = 1,
    dp: int = 1,
    stage: int = 0,
    precision: str | Precision = "bf16",
    persistent_params: int = 0,
) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients, master weights and optimizer states.

    ``model_or_params`` is Ψ (total parameters of the model) or a config-like object. Each TP
    rank holds Ψ_t = Ψ / tp; ZeRO then shards over ``dp`` ranks (ceil(Ψ_t / dp) elements each):
    stage 1 the optimizer states and master copy, stage 2 also gradients, stage 3 also parameters
    (ZeRO §5.1-5.3: 4Ψ + KΨ/N_d, 2Ψ + (2+K)Ψ/N_d, (4+K)Ψ/N_d with mixed precision, K = 12).
    ``precision`` is a name (paper accounting) or a ``Precision`` from ``get_precision`` (pass
    ``get_precision(name, "engine")`` to predict ``ZeroEngine.memory_bytes()``).
    ``persistent_params``: stage-3 elements kept whole (``persistent_parameters``); the engine
    also keeps their shard, so they cost Ψ_p/N_d + Ψ_p parameter elements.
    Returns {'params', 'grads', 'master', 'optimizer', 'total'} in bytes.
    """
    plan = stage_plan(stage)
    _check_positive(dp=dp)
    p = get_precision(precision)
    full = params_per_tp_rank(model_or_params, tp)
    shard = math.ceil(full / dp)
    os_, g, ps = plan.shards_optimizer_states, plan.shards_gradients, plan.shards_parameters
    out = {
        "params": (shard + persistent_params if ps else full) * p.param_bytes,
        "grads": (shard if g else full) * p.grad_bytes,
        "master": (shard if os_ else full) * p.master_bytes,
        "optimizer": (shard if os_ else full) * p.optimizer_bytes,
    }
    out["total"] = sum(out.values())
    return out


def state_bytes_per_param(stage: int, dp: int, precision: str | Precision = "bf16") -> float:
    """Model-state bytes per parameter of one TP shard on one rank (ZeRO §5, no rounding).

    Mixed precision: 16, 4 + 12/N_d, 2 + 14/N_d, 16/N_d for stages 0-3. Used to invert
    ZeRO Table 2 (max model size = memory * tp / this).
    """
    plan = stage_plan(stage)
    _check_positive(dp=dp)
    p = get_precision(precision)
    sharded = ((p.k if plan.shards_optimizer_states else 0)
               + (p.grad_bytes if plan.shards_gradients else 0)
               + (p.param_bytes if plan.shards_parameters else 0))
    return (p.state_bytes - sharded) + sharded / dp


# ----------------------------------------------------------------------------- activations


def checkpoint_bytes(
    num_layers: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tp: int = 1,
    partitioned: bool = False,
    bytes_per_element: int = 2,
) -> int:
    """Bytes of one-per-layer activation checkpoints (the layer inputs, [s, b, h] each) per rank.

    L s b h e replicated on every TP rank; divided by t with P_a (ZeRO §6.1, §8). The 100B example
    (L = 125, h = 8192, s = 1024, b = 32, t = 16) gives 67.1 GB, and 4.19 GB with P_a.
    """
    _check_positive(num_layers=num_layers, tp=tp)
    total = num_layers * seq_length * micro_batch_size * hidden_size * bytes_per_element
    return math.ceil(total / tp) if partitioned else total


def non_layer_activation_bytes(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    vocab_size: int,
    tp: int = 1,
    bytes_per_element: int = 2,
    sequence_parallel: bool = False,
    mask_bytes: int = 1,
) -> int:
    """Activations outside the layers per TP rank, in bytes (2205.05198 §4.3).

    Embedding-dropout mask sbh (``mask_bytes``), final-LayerNorm input and output-layer input
    2sbh*e, all three /t with sequence parallelism, and fp32 logits of the vocab-parallel
    cross-entropy 4sbV/t.
    """
    s, b, h = seq_length, micro_batch_size, hidden_size
    sliced = s * b * h * mask_bytes + 2 * s * b * h * bytes_per_element
    logits = math.ceil(4 * s * b * vocab_size / tp)
    return (math.ceil(sliced / tp) if sequence_parallel else sliced) + logits


def activation_bytes(
    model: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    option: str = "none",
    precision: str | Precision = "bf16",
    mask_bytes: int = 1,
    dropout: bool = True,
) -> dict[str, int]:
    """Activation memory of one micro-batch per rank, for one of ``ACTIVATION_OPTIONS``.

    The layer terms follow ``model``'s shape (GQA, SwiGLU, RoPE, q/k norms:
    :func:`hybrid.planner.activations.layer_saved_terms`); ``dropout=False`` is a model trained
    without dropout (no masks, SDPA attention core).

    - ``none``: L layers of ``layer_activation_bytes`` (TP form) + non-layer activations.
    - ``selective``, ``sp``, ``sp+selective``: L layers in that form (Table 2 rows).
    - ``full+sp``, ``full+sp+cpu``: checkpoints of sbh/t (the SP slice), one SP layer.
    - ``full``: L checkpoints of 2sbh + one layer's full activations (the recompute working set)
      + non-layer activations.
    - ``full+pa``: checkpoints divided by t (P_a, ZeRO §6.1).
    - ``full+pa+cpu``: the partitioned checkpoints live in CPU memory (reported as ``cpu``).
    Returns {'checkpoints', 'layers', 'non_layer', 'gpu', 'cpu'} in bytes.
    """
    if option not in ACTIVATION_OPTIONS:
        raise ValueError(f"activation option must be one of {ACTIVATION_OPTIONS}, got {option!r}")
    m = model
    e = get_precision(precision).activation_bytes
    parts = set(option.split("+"))
    sp, full = "sp" in parts, "full" in parts
    s, b, h, a = seq_length, micro_batch_size, m.hidden_size, m.num_attention_heads
    f = m.ffn_hidden_size
    recompute = "selective" if "selective" in parts else "none"
    one_layer = layer_activation_bytes(s, b, h, a, tp, f, sp, recompute, bytes_per_element=e,
                                       mask_bytes=mask_bytes, shape=m, dropout=dropout)
    non_layer = non_layer_activation_bytes(s, b, h, m.vocab_size, tp, e, sp,
                                           mask_bytes if dropout else 0)
    if not full:
        checkpoints, layers = 0, m.num_layers * one_layer
    else:
        checkpoints = checkpoint_bytes(m.num_layers, s, b, h, tp, option != "full", e)
        layers = one_layer
    cpu = checkpoints if "cpu" in parts else 0
    gpu = checkpoints - cpu + layers + non_layer
    return {
        "checkpoints": checkpoints,
        "layers": layers,
        "non_layer": non_layer,
        "gpu": gpu,
        "cpu": cpu,
    }


def activation_rule_of_thumb_bytes(
    hidden_size: int,
    micro_batch_size: int,
    seq_length: int,
    num_layers: int,
    bytes_per_element: int = 2,
) -> int:
    """ZeRO §3.2 footnote: all activations ≈ 12 h b s L elements (GPT-2 1.5B, b = 32: 60.4 GB)."""
    return 12 * hidden_size * micro_batch_size * seq_length * num_layers * bytes_per_element


# ----------------------------------------------------------------------------- buffers


def fused_buffer_bytes(num_elements: int, bytes_per_element: int = 4) -> int:
    """A flat buffer over ``num_elements`` (what Apex/Megatron allocate without C_B, ZeRO §3.2).

    A 1.5B model's fp32 fused gradient buffer is 6 GB, a 3B model's 12 GB (ZeRO §3.2, §6.2).
    """
    return num_elements * bytes_per_element


def comm_buffer_bytes(
    params_per_rank: int,
    stage: int,
    reduce_bucket_elements: int,
    allgather_bucket_elements: int,
    precision: str | Precision = "bf16",
    largest_layer_params: int = 0,
    dp: int = 1,
    overlap: bool = True,
    root_params: int = 0,
    unit_in_place: bool = False,
) -> int:
    """Bytes of constant-size communication buffers (C_B, ZeRO §6.2, arXiv:1910.02054) one rank
    holds, as :class:`hybrid.zero.engine.ZeroEngine` allocates them. Stage 0: none (in-place
    all-reduce). Stages 1-3: 2 (``overlap``) or 1 reduce-scatter pairs of ``dp * chunk`` +
    ``chunk`` gradient elements, ``chunk = min(reduce_bucket // dp, ceil(params_per_rank / dp))``,
    and one all-gather staging of ``min(allgather_bucket // dp, ...)`` parameter elements.
    Stage 3 also gathers the ``root`` unit (``root_params``: embeddings, final norm, untied
    head) for the whole step and two blocks of ``largest_layer_params`` (current + prefetch).
    ``unit_in_place`` (gradient-accumulation fusion, reduce-scatter): stage 1 reduce-scatters
    each unit in place in its gradient buffer, so it holds no reduce staging (on NCCL).
    """
    plan = stage_plan(stage)
    _check_positive(dp=dp)
    if not plan.shards_optimizer_states:
        return 0
    p = get_precision(precision)
    partition = math.ceil(params_per_rank / dp)
    chunk = min(max(1, reduce_bucket_elements // dp), partition)
    staging = (2 if overlap else 1) * (dp + 1) * chunk * p.grad_bytes
    if unit_in_place and not plan.shards_gradients:
        staging = 0
    staging += min(max(1, allgather_bucket_elements // dp), partition) * p.param_bytes
    if not plan.shards_parameters:
        return staging
    return staging + (root_params + 2 * largest_layer_params) * p.param_bytes
