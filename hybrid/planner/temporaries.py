"""The step's temporaries: bytes alive at a training step's peak beyond what backward keeps.

``hybrid.planner.memory.activation_bytes`` counts what autograd saves for backward (2205.05198
§4, checked against the saved-bytes meter). The step peak the dry run measures
(``hybrid.dryrun.dry_run``) also holds short-lived tensors; :func:`temporary_bytes` adds them so the
planner's total is the step peak. Derived from what the engine allocates (elements per TP rank;
``e`` the compute dtype's bytes, s sequence, b micro batch, h width, V the padded vocabulary,
t the TP degree):

- The loss's forward (``hybrid.parallel.cross_entropy``): the output layer's logits
  ``[s, b, V/t]`` in the compute dtype (``e`` B each) are alive while the loss upcasts them to fp32
  (``x``, 4 B; no copy in fp32 training) and forms ``shifted = x - max`` (4 B, which becomes the
  saved softmax the planner already counts as ``non_layer``). A rank holding padded vocabulary
  columns masks them in ``shifted`` itself, with no copy of the logits. The peak there is
  therefore ``sbV/t (e + 4 [e != 4])`` above the planner's activations (it still counted the
  masked fp32 clone the loss made before: +1.5 GiB, +18% of GPT-2 124M's total at s 1024, b 8,
  bf16, against the dry run's measured step peak); with full recompute the
  layer working set the planner counts (one layer's activations) is not alive in the forward,
  so it is subtracted.
- A block's backward: the loss's saved softmax (4 sbV/t, turned into the logits' gradient in
  place) is counted by the planner's activations and stays alive in the measured step (the dry
  run sees it through the blocks' backward); held beside it are the gradients of the root unit's
  output layer ``[V/t, h]`` (``e`` B) when they wait for the unit's reduction (ZeRO 2/3:
  ``hybrid.zero.reduce`` frees a unit's ``.grad`` only after its last bucket is reduced, and the
  root unit completes with the embedding, last) or for a tied embedding's second contribution
  (autograd sums both uses before accumulating); one block's gradients in the compute dtype
  before their reduce-scatter (ZeRO 2/3; stages 0/1 add each ``.grad`` into the fp32 flat buffer
  as it arrives, so only its largest weight, ``max(f, qkv) h / t`` elements, and none where the
  weight-gradient GEMMs accumulate into the fp32 buffer themselves: ``wgrad_fused``,
  :mod:`hybrid.parallel.linear.main_grad`); and the larger of two working sets that are not
  alive together:
  the MLP's backward, the gradients of its ``[s, b, f/t]`` activations (GeLU: 2 in the compute
  dtype; SwiGLU, ``models.swiglu``, works in fp32: the upcast gradient, gate and up (16-bit
  training only), the sigmoid, SiLU and one product of the chain, ``6 x 4 B``, ``3 x 4 B`` in
  fp32), or under sequence parallelism the all-gathered full-sequence input ``[s, b, h]`` of a
  column-parallel layer and its gradient (``2 sbh e``; ``hybrid.parallel.ops``). Besides, with
  the explicit attention core (``models.blocks``, attention dropout on) the gradients of its
  ``[b, a/t, s, s]`` scores as they pass back through dropout, softmax, the causal fill and the
  scaling, 4 of them alive at once as measured (``4 a s^2 b e / t``), and under selective
  recompute also the recomputed core, ``a s^2 b (2e + mask) / t`` (Table 2's ``5as^2b`` term).

- The embedding's backward, last: its lookup gradient ``[V/t, h]`` (``e`` B), for a tied
  embedding beside the output layer's contribution and their sum (``3 V h e / t``; untied: the
  output layer's still waits at ZeRO 2/3, ``2 V h e / t``), and at ZeRO 2/3 the gradients of
  the blocks whose reductions still wait (:func:`embedding_backward_bytes`, the bytes this
  phase allocates); the activations saved for backward are freed by then, so the planner
  compares it with the other phases less the activations (``hybrid.planner.plan.evaluate``).

``temporaries = max(loss forward, block backward, embedding backward - activations)`` (at least
0), bytes per rank.
"""

from __future__ import annotations

from hybrid.flops import layer_parameter_split
from hybrid.zero.stage import stage_plan
from models.config import GPTConfig


def temporary_bytes(model: GPTConfig, seq_length: int, micro_batch_size: int, tp: int, stage: int,
                    activation: str, bytes_per_element: int, real_vocab_size: int | None = None,
                    layer_bytes: int = 0, dropout: bool = True, mask_bytes: int = 1,
                    wgrad_fused: bool = False) -> dict[str, int]:
    """Bytes per rank alive at the step peak beyond the activations backward keeps.

    Args:
        model: config-like object (its ``vocab_size`` TP-padded).
        seq_length, micro_batch_size: s and b (tokens).
        tp: TP degree t; stage: ZeRO stage (0-3); activation: a ``memory.ACTIVATION_OPTIONS``
            name (``sp`` and ``full`` in it matter).
        bytes_per_element: the compute dtype's bytes e (2 for bf16/fp16, 4 for fp32).
        real_vocab_size: the unpadded vocabulary (None: no padding); padded columns cost
            nothing more (masked in the loss's own output), so it changes no term.
        layer_bytes: the one-layer working set the planner counts under full recompute.
        dropout: attention dropout on (the explicit attention core; off: SDPA).
        mask_bytes: bytes of a dropout-mask element.
        wgrad_fused: stages 0/1 with 16-bit weights and fp32 gradients under
            ``--gradient-accumulation-fusion``: no weight gradient exists in the compute dtype.

    Returns:
        ``{"loss_forward", "block_backward", "total"}`` bytes (see the module docstring);
        ``total`` is the larger, at least 0 (the planner adds :func:`embedding_backward_bytes`).

    Raises:
        ValueError: ``tp`` not positive or ``stage`` outside 0-3.
    """
    if tp <= 0 or stage not in (0, 1, 2, 3):
        raise ValueError(f"tp must be positive and stage in 0-3, got tp={tp}, stage={stage}")
    m, reduced = model, stage_plan(stage).reduce_every_micro_batch
    parts = set(activation.split("+"))
    e, s, b, h = bytes_per_element, seq_length, micro_batch_size, m.hidden_size
    logits = s * b * (m.vocab_size // tp)
    loss = logits * (e + (4 if e != 4 else 0))
    loss -= layer_bytes if "full" in parts else 0
    sharded, replicated = layer_parameter_split(m)
    tied = not m.untie_embeddings_and_output_weights
    head = (m.vocab_size // tp) * h if reduced or tied else 0
    if reduced:  # each micro-batch's block gradients wait in the compute dtype for their reduce
        block = sharded // tp + replicated
    else:
        block = 0 if wgrad_fused else max(m.ffn_hidden_size, m.qkv_size) * h // tp
    mlp = s * b * (m.ffn_hidden_size // tp) * ((6 if e < 4 else 3) * 4 if m.swiglu else 2 * e)
    gathered = 2 * s * b * h * e if "sp" in parts and tp > 1 else 0
    backward = (head + block) * e + max(mlp, gathered)
    if dropout:
        scores = m.num_attention_heads // tp * s * s * b
        backward += scores * 4 * e + (scores * (2 * e + mask_bytes) if "selective" in parts else 0)
    return {"loss_forward": loss, "block_backward": backward, "total": max(0, loss, backward)}


def embedding_backward_bytes(model: GPTConfig, tp: int, stage: int, bytes_per_element: int,
                             bucket_elements: int, kept_bytes: int, overlap: bool = True) -> int:
    """Temporaries of the embedding's backward, the last of the step (module docstring), bytes
    per rank: ``(V h / t x (3 tied, 2 untied at ZeRO 2/3, else 1) + held) e - kept_bytes`` (the
    saved activations are freed by then) ``- 2 x block e`` at ZeRO 3 (only the root unit is
    gathered then). ``held`` (ZeRO 2/3): the blocks' gradients still waiting, ``min(L x block,
    (3 with overlap, else 2) x bucket_elements)``: the bucket shared with the root unit, which
    completes only now, and the reductions in flight. ``bucket_elements``: one reduce bucket over
    the data-parallel group (``dp x chunk``, ``memory.comm_buffer_bytes``); ``block``: one
    layer's local parameters. Raises ValueError for tp <= 0."""
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    m, plan = model, stage_plan(stage)
    sharded, replicated = layer_parameter_split(m)
    block = sharded // tp + replicated
    vh = (m.vocab_size // tp) * m.hidden_size
    tied = not m.untie_embeddings_and_output_weights
    out = vh * (3 if tied else 2 if plan.reduce_every_micro_batch else 1)
    if plan.reduce_every_micro_batch:
        out += min(m.num_layers * block, (3 if overlap else 2) * bucket_elements)
    return out * bytes_per_element - kept_bytes - (2 * block * bytes_per_element
                                                   if plan.shards_parameters else 0)
