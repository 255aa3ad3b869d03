"""Communication volume per rank per training step: data-parallel (ZeRO) and tensor-parallel.

"Volume" is what one rank sends, in elements (multiply by bytes per element for bytes); a ring
collective over n ranks of a message of M elements sends M (n-1)/n for all-gather and
reduce-scatter and 2M (n-1)/n for all-reduce. ZeRO §7 drops the (n-1)/n factor;
``ring_factor=False`` reproduces the paper's numbers.

Sources:
- Data parallel: ZeRO (1910.02054) §7.1-7.2: 2Ψ for DDP, ZeRO-1 and ZeRO-2, 3Ψ for ZeRO-3;
  with gradient accumulation, the schedule of ``hybrid.zero.engine.ZeroEngine``
  (``dp_traffic_by_kind``).
- Tensor parallel: Megatron-LM (1909.08053) §3 / Fig. 4 (4 all-reduces per layer), Narayanan et al.
  (2104.04473) §3.2 (8bsh(t-1)/t per layer per micro-batch), ZeRO §8 (6 all-reduces with
  recompute, plus one P_a all-gather of the block input).
"""

from __future__ import annotations

from hybrid.planner.memory import params_per_tp_rank
from hybrid.planner.precision import Precision, get_precision
from hybrid.zero.stage import stage_plan


def _ring(n: int, ring_factor: bool) -> float:
    if n <= 0:
        raise ValueError(f"group size must be positive, got {n}")
    return (n - 1) / n if ring_factor else 1.0


def dp_traffic_by_kind(
    model_or_params: object,
    dp: int,
    stage: int,
    tp: int = 1,
    micro_batches_per_step: int = 1,
    ring_factor: bool = True,
    persistent_params: int = 0,
    grad_reduce: str = "reduce_scatter",
) -> dict[str, float]:
    """Elements one rank sends over its data-parallel group per optimizer step, per collective.

    Returns {'all_reduce', 'reduce_scatter', 'all_gather'} (the ``hybrid.zero.comm`` ledger
    names). Ψ_t = the rank's TP shard (``memory_estimate.params_per_tp_rank``), m micro-batches:

    - stage 0: all-reduce of the gradients once per step (the last micro-batch): 2Ψ_t;
    - stage 1: reduce-scatter once per step (the last micro-batch) + all-gather of the updated
      parameters: Ψ_t + Ψ_t;
    - stage 2: the gradient is partitioned, so every micro-batch reduce-scatters: mΨ_t + Ψ_t;
    - stage 3: every micro-batch reduce-scatters and gathers the parameters in forward and again
      in backward: mΨ_t + 2mΨ_t (ZeRO §7.2.2: 3Ψ at m = 1). ``persistent_params`` Ψ_p
      (``memory_estimate.persistent_parameters``) are never released, so they are gathered once
      after the step instead: mΨ_t + 2m(Ψ_t - Ψ_p) + Ψ_p.

    ``grad_reduce="all_reduce"`` (``ZeroConfig.grad_reduce``, stages 1-3): every gradient
    reduce-scatter above is an all-reduce of the same buffer instead, 2Ψ_t where it was Ψ_t.

    This is what ``hybrid.zero.engine.ZeroEngine`` issues (its ledger equals it up to the layout's
    padding). Times (dp-1)/dp when ``ring_factor`` (an all-reduce counts 2 (dp-1)/dp); all 0 when
    dp == 1.
    """
    plan = stage_plan(stage)
    if micro_batches_per_step <= 0:
        raise ValueError(f"micro_batches_per_step must be positive, got {micro_batches_per_step}")
    psi = params_per_tp_rank(model_or_params, tp)
    if not 0 <= persistent_params <= psi:
        raise ValueError(f"persistent_params must be in [0, {psi}], got {persistent_params}")
    m, ring = micro_batches_per_step, _ring(dp, ring_factor)
    if grad_reduce not in ("reduce_scatter", "all_reduce"):
        raise ValueError(
            f"grad_reduce must be 'reduce_scatter' or 'all_reduce', got {grad_reduce!r}")
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if not plan.shards_optimizer_states:
        out["all_reduce"] = 2 * psi
    else:
        out["reduce_scatter"] = (m if plan.reduce_every_micro_batch else 1) * psi
        out["all_gather"] = (2 * m * (psi - persistent_params) + persistent_params
                             if plan.shards_parameters else psi)
    if plan.shards_optimizer_states and grad_reduce == "all_reduce":
        out["all_reduce"], out["reduce_scatter"] = 2 * out["reduce_scatter"], 0.0
    return {k: v * ring for k, v in out.items()}


def qgz_bytes_per_element(bits: int, dp: int, local: int) -> tuple[float, float]:
    """ZeRO++ qgZ (arXiv 2306.10209 §3.3; ``hybrid.zero.qgz``): ``(intra-node, inter-node)``
    bytes one rank sends per element of its gradient reduce-scatter input, over ``dp`` ranks
    with ``local`` of them per node (``L = min(local, dp)``, ``N = dp / L`` nodes). Each element
    travels as ``q = bits / 8 + 4 / 256`` bytes (the code plus its block's fp32 scale,
    ``hybrid.zero.quantize``); the intra-node all-to-all sends ``(L-1)/L`` of the input, the
    inter-node one ``(N-1)/(N L)`` (the node-reduced partial sums): ``(L-1)/L q`` and
    ``(N-1)/(N L) q``. Block padding is neglected (< 256 elements per bucket row).

    Raises:
        ValueError: ``local`` does not divide ``dp`` (nor exceeds it), or ``bits`` not 4/8.
    """
    from hybrid.zero.quantize import BLOCK, QUANT_BITS

    if bits not in QUANT_BITS:
        raise ValueError(f"qgZ bits must be one of {QUANT_BITS}, got {bits}")
    L = min(local, dp)
    if L <= 0 or dp % L:
        raise ValueError(f"{local} data-parallel ranks per node do not divide dp {dp}")
    N, q = dp // L, bits / 8 + 4 / BLOCK
    return (L - 1) / L * q, (N - 1) / (N * L) * q


def dp_traffic_elements(
    model_or_params: object,
    dp: int,
    stage: int,
    tp: int = 1,
    micro_batches_per_step: int = 1,
    ring_factor: bool = True,
    persistent_params: int = 0,
) -> float:
    """Total of ``dp_traffic_by_kind``: 2Ψ_t for stages 0-1, (m + 1)Ψ_t for stage 2 and 3mΨ_t
    for stage 3 (no persistent parameters), ZeRO §7 at m = 1."""
    return sum(
        dp_traffic_by_kind(
            model_or_params, dp, stage, tp, micro_batches_per_step, ring_factor, persistent_params
        ).values()
    )


def dp_traffic_bytes(
    model_or_params: object,
    dp: int,
    stage: int,
    tp: int = 1,
    precision: str | Precision = "bf16",
    micro_batches_per_step: int = 1,
    ring_factor: bool = True,
    persistent_params: int = 0,
    by_kind: bool = False,
    grad_reduce: str = "reduce_scatter",
    qgz: tuple[int, int] | None = None,
) -> float | dict[str, float]:
    """``dp_traffic_by_kind`` in bytes: gradients (all-reduce, reduce-scatter) at the precision's
    ``grad_bytes``, parameter all-gathers at its ``param_bytes``. Paper accounting: 2 and 2 with
    mixed precision, 4 and 4 in fp32; engine accounting (``get_precision(p, "engine")``): fp32
    gradients (4) and parameters in the compute dtype. The total, or a dict when ``by_kind``.
    ``qgz=(bits, dp ranks per node)``: stages 2-3 reduce-scatter as ZeRO++ qgZ does, intra- plus
    inter-node payload bytes per input element (:func:`qgz_bytes_per_element`) instead of the
    ring's ``(n-1)/n grad_bytes``."""
    p = get_precision(precision)
    elems = dp_traffic_by_kind(
        model_or_params, dp, stage, tp, micro_batches_per_step, ring_factor, persistent_params,
        grad_reduce,
    )
    out = {
        "all_reduce": elems["all_reduce"] * p.grad_bytes,
        "reduce_scatter": elems["reduce_scatter"] * p.grad_bytes,
        "all_gather": elems["all_gather"] * p.param_bytes,
    }
    if qgz is not None and stage >= 2 and dp > 1:
        out["reduce_scatter"] = (elems["reduce_scatter"] / _ring(dp, ring_factor)
                                 * sum(qgz_bytes_per_element(qgz[0], dp, qgz[1])))
    return out if by_kind else sum(out.values())


def tp_collectives_per_layer(
    recompute: bool = False, partitioned_activations: bool = False
) -> dict[str, int]:
    """Tensor-parallel collectives one transformer layer issues per micro-batch.

    2 all-reduces forward (g after attention and after the MLP) and 2 backward (f), so 4
    (1909.08053 Fig. 4); recomputing the forward adds 2 (6 in all, ZeRO §8); P_a adds one
    all-gather of the checkpointed block input before recompute (ZeRO §8).
    """
    return {
        "all_reduce": 6 if recompute else 4,
        "all_gather": 1 if (recompute and partitioned_activations) else 0,
    }


def tp_traffic_elements(
    micro_batch_size: int,
    seq_length: int,
    hidden_size: int,
    tp: int,
    num_layers: int = 1,
    recompute: bool = False,
    partitioned_activations: bool = False,
    vocab_size: int | None = None,
    ring_factor: bool = True,
    sequence_parallel: bool = False,
) -> float:
    """Elements one rank sends over its TP group per micro-batch.

    With ``sequence_parallel`` each all-reduce becomes an all-gather + reduce-scatter of the same
    total (2205.05198 §4.2.2), and the s/t inputs of the two column-parallel layers (and of the
    output layer when ``vocab_size`` is given) are all-gathered again in backward: bsh(t-1)/t each.

    Per layer, each all-reduce of an [s, b, h] tensor sends 2bsh(t-1)/t: 8bsh(t-1)/t for the 4 of
    a plain layer (2104.04473 §3.2), 12bsh(t-1)/t with recompute, plus bsh(t-1)/t for the P_a
    all-gather (ZeRO §8, <10% extra). When ``vocab_size`` is given the model's ends are added:
    the all-reduce after the vocab-parallel embedding (forward), the one at the output layer's
    input (backward), and 3 all-reduces of [s, b] in the fused cross-entropy (max, target logit,
    sum of exp) instead of an all-gather of bsV logits (1909.08053 §3). 0 when tp == 1.
    """
    if tp <= 0 or num_layers <= 0:
        raise ValueError(f"tp and num_layers must be positive, got {tp}, {num_layers}")
    bsh = micro_batch_size * seq_length * hidden_size
    counts = tp_collectives_per_layer(recompute, partitioned_activations)
    per_layer = (2 * counts["all_reduce"] + counts["all_gather"]) * bsh
    if sequence_parallel:
        per_layer += 2 * bsh
    total = num_layers * per_layer
    if vocab_size is not None:
        total += (2 * 2 * bsh + 3 * 2 * micro_batch_size * seq_length
                  + (bsh if sequence_parallel else 0))
    return total * _ring(tp, ring_factor)


def vocab_parallel_cross_entropy_elements(
    micro_batch_size: int, seq_length: int, vocab_size: int
) -> dict[str, int]:
    """Message sizes (elements) of the fused vocab-parallel cross-entropy vs gathering logits.

    Fused: 3 all-reduces of b s values each; naive: all-gather of b s V logits
    (1909.08053 §3; b = 8, s = 1024, V = 51,200 avoids 419,430,400 elements).
    """
    bs = micro_batch_size * seq_length
    return {"fused_per_collective": bs, "fused_collectives": 3, "naive_all_gather": bs * vocab_size}
