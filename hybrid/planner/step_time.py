"""The planner's step time, honest about what the engine overlaps (issue 34 item 1).

One rank, one optimizer step of ``m`` micro-batches through ``N`` transformer blocks (the ZeRO-3
gather units, ``hybrid.zero.stage3``) and the ``root`` unit (embedding, final norm, logits and
loss). Every term is seconds; bytes move at the cluster's achieved bus bandwidths (GB/s).

Compute (GEMMs at ``peak * efficiency``, the FLOPs of :func:`hybrid.flops.flops_per_iteration`:
2205.05198 Eq. 7/8, 2104.04473 Eq. 3): per micro-batch a block's forward is ``2bs(4h^2 + 2hf)
+ 4bs^2h`` FLOPs / tp, its backward the rest of the block's share (2x, + the recomputed forward
with full checkpointing); the root's forward is the logits ``2bshV`` / tp and its backward 2x.

Tensor parallelism (Megatron 2104.04473 §3.2, sequence parallelism 2205.05198 §4.2.2), one
collective of an ``[s, b, h]`` tensor = ``bsh (t-1)/t`` bytes-units, an all-reduce two. What the
engine (``hybrid.parallel.ops``) runs on the compute stream, i.e. *exposed*: the 2 all-reduces
of a block's forward and the 2 of its backward (without SP), or the forward's 2 all-gathers and
2 reduce-scatters and the backward's 2 gradient all-gathers (SP), the recomputed forward's
collectives and P_a's all-gather; the model's ends (embedding, output layer, cross-entropy).
What it overlaps (SP backward only, as Megatron-LM): each column-parallel layer's input
re-gather runs during its input-gradient GEMM and the input gradient's reduce-scatter during
its weight-gradient GEMM, so only ``max(0, collective - GEMM)`` of each is exposed. With
``--tp-comm-overlap`` (SP) the forward's all-gathers and reduce-scatters and the row-parallel
gradient all-gathers run as rings pipelined with their GEMMs (:func:`ring_exposed`).

Data parallelism (ZeRO 1910.02054 §5.3 and §7; the engine's schedule, ``traffic``); its
collectives cross nodes on the NICs while the exposed TP collectives use NVLink, so a unit's
critical path (GEMMs + exposed TP) hides them:

- stage 3, every micro-batch: forward gathers the root (waited) and prefetches block 0, then
  block ``i``'s forward runs while block ``i+1`` is gathered; backward re-gathers the root,
  the head's backward hides the last block's gather, block ``i``'s backward hides block
  ``i-1``'s gather and block ``i+1``'s gradient reduce-scatter (one link: they add up);
- stages 0-2: the gradients of a block are reduced (stage 0 all-reduce, 1-2 reduce-scatter)
  during the next block's backward, in the last micro-batch (0-1) or every one (2); without
  ``overlap_comm`` after backward instead;
- exposed: the *first gather* (root + block 0 in forward, the root in backward), the *last
  reduce* (block 0, root and stage 3's persistent parameters, which complete only when backward
  ends), the *refresh* (the all-gather of the updated parameters after the step, ZeRO §5.1:
  stages 1-2 whole, stage 3 its persistent parameters) and, per unit, what a collective takes
  beyond the compute it overlaps: ``sum_units max(compute, comm)``.

``overlap_param_gather`` (Megatron-LM's ``--overlap-param-gather``, off by default there): the
refresh gathers of stages 1-2 are launched after the step and waited block by block in the next
forward, so the first micro-batch's forward pays them like stage 3's prefetch (the root and
block 0 exposed, the rest hidden behind the blocks' forward).

ZeRO++ qgZ (``quantized_gradients``, arXiv 2306.10209 §3.3): a stage 2-3 gradient reduce-scatter
moves ``intra`` bytes per element over NVLink and then ``inter`` over the network
(:func:`hybrid.planner.traffic.qgz_bytes_per_element`, the two all-to-alls in sequence).

P_a+cpu (ZeRO §6.1): on CUDA the engine copies a block's checkpoint to the host on a side
stream during the block's forward and prefetches the next one back during a block's backward
(``hybrid.activation.offload``); the first load of each backward is exposed.

Optimizer (exposed, HBM-bound): AdamW (1711.05101) reads and writes the fp32 master and its
two moments (``2k`` bytes, ZeRO §3.1's K = 12), reads the gradient and writes the compute-dtype
parameter per owned element (``Psi_t`` at stage 0, ``Psi_t / dp`` at 1-3, ZeRO §5.1); the
gradient norm reads the owned gradients and zeroing writes the held ones.
ZeRO-Offload (``offloaded`` elements, :mod:`hybrid.planner.offload`): the device AdamW covers
the kept share, the host's step and copies are that module's; the optimizer's exposed time is
the longer of the device and the host step, plus the gradient copy backward did not hide.
ZeRO++ (``hybrid.planner.zeropp``): qwZ's gathers move ``1 + 4/2048`` bytes per element; hpZ's
backward gathers run over the node's ``N`` ranks at the intra-node bandwidth.
Not modelled: the gradient-norm all-reduce (one scalar per rank), kernel launch gaps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hybrid.flops import flops_per_iteration, layer_parameter_split
from hybrid.planner.inputs import GB
from hybrid.planner.memory import params_per_tp_rank, persistent_parameters
from hybrid.planner.offload import offload_seconds
from hybrid.planner.traffic import qgz_bytes_per_element
from hybrid.planner.zeropp import gather_terms


@dataclass(frozen=True)
class UnitSeconds:
    """Seconds of each unit on one rank for one micro-batch. ``*_fwd``/``*_bwd``: the critical
    path (GEMMs + exposed tensor-parallel collectives); ``gather_*``/``reduce_*``: one
    data-parallel collective of the unit; ``tp_*``: the tensor-parallel part of the critical
    path and what the SP backward hides."""

    block_fwd: float
    block_bwd: float
    root_fwd: float
    root_bwd: float
    gather_block: float
    gather_root: float
    reduce_block: float
    reduce_tail: float
    """Root + persistent parameters: reduced when backward ends."""
    compute: float
    """GEMM seconds of one micro-batch (all units, no communication)."""
    tp_exposed: float
    tp_hidden: float
    tp_ring_hidden: float = 0.0
    """Of ``tp_hidden``: what ``--tp-comm-overlap``'s rings hide (:func:`ring_exposed`)."""
    offload_block: float = 0.0
    """P_a+cpu: one block's checkpoint copied one way between GPU and host."""
    gather_block_bwd: float | None = None
    """A backward gather of a block when it differs from the forward's (ZeRO++ hpZ / qwZ)."""
    gather_root_bwd: float | None = None


def compute_seconds(model, b: int, s: int, tp: int, recompute: str, flops_per_s: float
                    ) -> dict[str, float]:
    """``{'block_fwd', 'block_bwd', 'root_fwd', 'root_bwd'}``: GEMM seconds of one micro-batch of
    ``b`` sequences on one rank (FLOPs / tp / ``flops_per_s``); ``N * (fwd + bwd)`` of the blocks
    plus the root's equals ``flops_per_iteration(model, b, s, recompute) / tp / flops_per_s``."""
    m = model
    h, f, n = m.hidden_size, m.ffn_hidden_size, m.num_layers
    logits = 2 * b * s * h * m.vocab_size
    fwd = 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h
    block = (flops_per_iteration(m, b, s, recompute) - 3 * logits) / n
    k = 1 / (tp * flops_per_s)
    return {"block_fwd": fwd * k, "block_bwd": (block - fwd) * k, "root_fwd": logits * k,
            "root_bwd": 2 * logits * k}


def ring_exposed(unit: float, gemm: float, tp: int) -> float:
    """Seconds a collective of ``unit`` seconds leaves exposed when it is decomposed into the
    ``tp`` chunks of a ring pipelined with its GEMM of ``gemm`` seconds (collective matmul,
    ``hybrid.parallel.linear.collective_matmul``; Wang et al. 2023,
    doi:10.1145/3567955.3567959, §3):
    ``tp - 1`` transfers of ``unit / (tp - 1)`` each run beside one of ``tp`` GEMM chunks of
    ``gemm / tp``, one chunk (the first all-gather chunk is local, the last reduce-scatter chunk
    is the rank's own) has nothing to hide: ``(tp-1) max(0, unit/(tp-1) - gemm/tp)`` = ``max(0,
    unit - gemm (tp-1)/tp)``."""
    return max(0.0, unit - gemm * (tp - 1) / tp)


def tp_seconds(model, b: int, s: int, tp: int, parts: set, act_bytes: int, intra_gbs: float,
               flops_per_s: float, comm_overlap: bool = False) -> dict[str, float]:
    """Tensor-parallel seconds of one micro-batch on one rank (see the module docstring):
    ``{'block_fwd', 'block_bwd', 'root_fwd', 'root_bwd'}`` exposed, ``'block_hidden'`` hidden
    behind the block's GEMMs (``'block_ring_hidden'`` of it by ``comm_overlap``'s rings). Their
    bytes are ``traffic.tp_traffic_elements``'s.

    ``comm_overlap`` (``--tp-comm-overlap``, SP only): the forward's two all-gathers (qkv, fc1)
    and two reduce-scatters (proj, fc2), the recomputed forward's under full recompute, and the
    row-parallel layers' gradient all-gathers in backward (proj, fc2; pipelined with their
    input-gradient GEMMs) each leave :func:`ring_exposed` of their GEMM (the planner's FLOP
    split: qkv ``3h^2``, proj ``h^2``, fc1 and fc2 ``hf`` per token, 2 FLOPs per MAC)."""
    if tp == 1:
        return dict.fromkeys(("block_fwd", "block_bwd", "root_fwd", "root_bwd", "block_hidden",
                              "block_ring_hidden"), 0.0)
    h, f = model.hidden_size, model.ffn_hidden_size
    ring = (tp - 1) / tp
    unit = b * s * h * ring * act_bytes / (intra_gbs * GB)  # one [s, b, h] collective
    sp, full, pa = "sp" in parts, "full" in parts, "pa" in parts
    gemm = {k: 2 * b * s * h * n / tp / flops_per_s
            for k, n in (("qkv", 3 * h), ("proj", h), ("fc1", f), ("fc2", f))}
    rings = comm_overlap and sp
    fwd = sum(ring_exposed(unit, gemm[k], tp) for k in gemm) if rings else 4 * unit
    grad_gathers = (sum(ring_exposed(unit, gemm[k], tp) for k in ("proj", "fc2")) if rings
                    else 2 * unit)
    bwd = (grad_gathers if sp else 4 * unit) + (fwd if full else 0) + (unit if pa else 0)
    remainder = hidden = 0.0
    if sp:  # qkv (3h^2 of 4h^2) and fc1 (hf of 2hf): dgrad and wgrad GEMM each
        for k in ("qkv", "fc1"):
            remainder += 2 * max(0.0, unit - gemm[k])
        hidden = 4 * unit - remainder
    ring_hidden = (4 * unit - fwd) * (2 if full else 1) + 2 * unit - grad_gathers if rings else 0
    cross_entropy = 3 * 2 * b * s * ring * act_bytes / (intra_gbs * GB)
    return {"block_fwd": fwd, "block_bwd": bwd + remainder, "block_hidden": hidden + ring_hidden,
            "block_ring_hidden": ring_hidden,
            "root_fwd": 2 * unit + cross_entropy, "root_bwd": 2 * unit + (unit if sp else 0)}


def dp_unit_elements(model, tp: int, psi_t: int, threshold: int) -> dict[str, int]:
    """Elements of one rank's TP shard per unit: ``block`` (one block), ``root`` (the rest:
    embedding, final norm, untied head), ``block_persistent`` and ``root_persistent`` (what
    stage 3 keeps whole at ``threshold``, ``memory.persistent_parameters``: a block's LayerNorms
    and biases; 0 when ``threshold`` is 0)."""
    sharded, replicated = layer_parameter_split(model)
    block = sharded // tp + replicated
    one, two = (dataclasses.replace(model, num_layers=k) for k in (1, 2))
    per_layer = persistent_parameters(two, tp, threshold) - persistent_parameters(
        one, tp, threshold)
    total = persistent_parameters(model, tp, threshold)
    return {"block": block, "root": psi_t - model.num_layers * block,
            "block_persistent": per_layer, "root_persistent": total - model.num_layers * per_layer}


def overlapped(units: list[tuple[float, ...]]) -> tuple[float, float, float]:
    """``(sum max(c, w, o), sum max(0, w - c), sum max(0, o - max(c, w)))`` over ``(compute,
    collectives, host copies)`` units (a missing ``o`` is 0): a unit lasts as long as the
    longest of its compute, the data-parallel collectives and the host copies launched beside
    it (three links: NVLink under the compute stream, the NIC, PCIe); the other two terms are
    the collectives and the copies it did not hide."""
    time = dp = cpu = 0.0
    for c, w, *rest in units:
        o = rest[0] if rest else 0.0
        time += max(c, w, o)
        dp += max(0.0, w - c)
        cpu += max(0.0, o - max(c, w))
    return time, dp, cpu


def forward_pass(u: UnitSeconds, n: int, gathers: bool) -> dict[str, float]:
    """One forward: ``{'time', 'first_gather', 'unhidden', 'unhidden_cpu'}``. With ``gathers``
    (stage 3, or the first forward after a deferred refresh) the root and block 0 are waited
    for (exposed) and block ``i+1``'s gather runs during block ``i``: ``g_r + g + (N-1) max(F,
    g) + F + R_f``; P_a+cpu's copy of block ``i``'s checkpoint to the host runs during block
    ``i`` (a side stream, ``hybrid.activation.offload``)."""
    g, o = (u.gather_block if gathers else 0.0), u.offload_block
    units = [(u.block_fwd, g, o)] * (n - 1) + [(u.block_fwd, 0.0, o), (u.root_fwd, 0.0)]
    time, unhidden, unhidden_cpu = overlapped(units)
    first = u.gather_root + u.gather_block if gathers else 0.0
    return {"time": time + first, "first_gather": first, "unhidden": unhidden,
            "unhidden_cpu": unhidden_cpu}


def backward_pass(u: UnitSeconds, n: int, gathers: bool, reduces: bool, overlap_comm: bool
                  ) -> dict[str, float]:
    """One backward: ``{'time', 'first_gather', 'last_reduce', 'first_load', 'unhidden',
    'unhidden_cpu'}``. Units run head first, then blocks ``N-1 .. 0``; the head hides the last
    block's gather; block ``i`` hides block ``i-1``'s gather (``gathers``), block ``i+1``'s
    reduction (``reduces`` and ``overlap_comm``) and block ``i-1``'s checkpoint coming back from
    the host (P_a+cpu's prefetch); the root's re-gather and the last block's checkpoint load
    come first, block 0's, the root's and the persistent parameters' reductions last (exposed);
    without ``overlap_comm`` every reduction is."""
    g_bwd = u.gather_block if u.gather_block_bwd is None else u.gather_block_bwd
    g_root = u.gather_root if u.gather_root_bwd is None else u.gather_root_bwd
    g = g_bwd if gathers else 0.0
    r = u.reduce_block if reduces and overlap_comm else 0.0
    o = u.offload_block
    units = [(u.root_bwd, g)]
    for i in range(n - 1, -1, -1):
        units.append((u.block_bwd, (g if i >= 1 else 0.0) + (r if i <= n - 2 else 0.0),
                      o if i >= 1 else 0.0))
    time, unhidden, unhidden_cpu = overlapped(units)
    first = g_root if gathers else 0.0
    last = 0.0
    if reduces:
        last = u.reduce_tail + (u.reduce_block if overlap_comm else n * u.reduce_block)
    return {"time": time + first + o + last, "first_gather": first, "last_reduce": last,
            "first_load": o, "unhidden": unhidden, "unhidden_cpu": unhidden_cpu}


def step_seconds(u: UnitSeconds, n: int, micro_batches: int, stage: int, refresh: float,
                 optimizer: float, overlap_param_gather: bool = False,
                 overlap_comm: bool = True) -> dict[str, float]:
    """The step's seconds, named: ``compute_s`` (GEMMs), ``tp_exposed_s``, ``first_gather_s``,
    ``last_reduce_s``, ``unhidden_dp_s`` (collectives beyond the compute they overlap),
    ``refresh_s``, ``optimizer_s``, ``cpu_exposed_s`` (the first checkpoint load of each
    backward and copies beyond the compute), all exposed, their sum ``step_s``, and what is
    hidden (``tp_hidden_s``). ``refresh`` is the parameter all-gather after the step (deferred
    into the first forward at stages 1-2 with ``overlap_param_gather``)."""
    deferred = overlap_param_gather and stage in (1, 2)
    out = dict.fromkeys(("first_gather_s", "last_reduce_s", "unhidden_dp_s", "cpu_exposed_s"),
                        0.0)
    path = 0.0
    fwds = {g: forward_pass(u, n, g) for g in (False, True)}  # micro-batches differ only by
    bwds = {r: backward_pass(u, n, stage == 3, r, overlap_comm) for r in (False, True)}  # these
    for j in range(micro_batches):
        fwd = fwds[stage == 3 or (deferred and j == 0)]
        bwd = bwds[stage >= 2 or j == micro_batches - 1]
        path += fwd["time"] + bwd["time"]
        out["first_gather_s"] += fwd["first_gather"] + bwd["first_gather"]
        out["last_reduce_s"] += bwd["last_reduce"]
        out["unhidden_dp_s"] += fwd["unhidden"] + bwd["unhidden"]
        out["cpu_exposed_s"] += bwd["first_load"] + fwd["unhidden_cpu"] + bwd["unhidden_cpu"]
    out.update(compute_s=micro_batches * u.compute, tp_exposed_s=micro_batches * u.tp_exposed,
               tp_hidden_s=micro_batches * u.tp_hidden,
               tp_ring_hidden_s=micro_batches * u.tp_ring_hidden,
               refresh_s=0.0 if deferred else refresh,
               optimizer_s=optimizer)
    out["step_s"] = path + out["refresh_s"] + optimizer
    return out


def optimizer_seconds(psi_t: int, dp: int, stage: int, prec, hbm_gbs: float,
                      offloaded: int = 0) -> float:
    """AdamW's HBM seconds per step (module docstring): owned elements x (2k + 2 grad_bytes +
    param_bytes) + held gradient elements x grad_bytes, over ``hbm_gbs`` GB/s; ``offloaded``
    owned elements step on the host (:mod:`hybrid.planner.offload`): the device still reads
    their gradients for the norm, nothing more."""
    owned = psi_t if stage == 0 else psi_t / dp
    held = psi_t / dp if stage >= 2 else psi_t
    kept = owned - offloaded
    nbytes = (kept * (2 * prec.k + prec.grad_bytes + prec.param_bytes) + owned * prec.grad_bytes
              + held * prec.grad_bytes)
    return nbytes / (hbm_gbs * GB)


def qgz_setting(training, gpus_per_node: int, tp: int, dp: int) -> tuple[int, int] | None:
    """``(bits, data-parallel ranks per node)`` of ZeRO++ qgZ for ``Training`` ``training``, or
    None when it is off. A node holds ``gpus_per_node / tp`` ranks of a data-parallel group
    (tp inside the node), at most ``dp``; a partial last node counts by the gcd."""
    if not training.zero.quantized_gradients:
        return None
    return training.zero.quantized_gradients_bits, math.gcd(dp, max(1, gpus_per_node // tp))


def qgz_intra_bytes(dp_kinds: dict, training, gpus_per_node: int, tp: int, dp: int,
                    stage: int) -> float:
    """Of ``dp_kinds["reduce_scatter"]`` (bytes), those qgZ's intra-node all-to-all sends (0
    without qgZ): the rest crosses nodes."""
    qgz = qgz_setting(training, gpus_per_node, tp, dp)
    if qgz is None or stage < 2 or dp == 1:
        return 0.0
    intra, inter = qgz_bytes_per_element(qgz[0], dp, qgz[1])
    return dp_kinds["reduce_scatter"] * intra / (intra + inter)


def step_breakdown(model, cluster, training, tp: int, dp: int, stage: int, activation: str,
                   prec, threshold: int, micro_batches: int, cpu_bytes: float,
                   offloaded: int = 0) -> dict[str, float]:
    """:func:`step_seconds` of one layout: ``model`` with its TP-padded vocabulary, a
    ``planner.inputs.Cluster`` and ``Training``, the stage's persistence ``threshold``
    (elements), ``cpu_bytes`` to and from the host per step (P_a+cpu: every block's
    checkpoint out in forward and back in backward), ``offloaded`` owned elements whose
    optimizer runs on the host (:func:`with_offload`)."""
    parts = set(activation.split("+"))
    b, s, n = training.micro_batch_size, training.seq_length, model.num_layers
    flops_per_s = cluster.peak_tflops * 1e12 * cluster.efficiency
    recompute = "full" if "full" in parts else "selective" if "selective" in parts else "none"
    comp = compute_seconds(model, b, s, tp, recompute, flops_per_s)
    tps = tp_seconds(model, b, s, tp, parts, prec.activation_bytes, cluster.intra_node_gbs,
                     flops_per_s, training.tp_comm_overlap)
    el = dp_unit_elements(model, tp, params_per_tp_rank(model, tp), threshold if stage == 3 else 0)
    bw = (cluster.inter_node_gbs if cluster.num_gpus > cluster.gpus_per_node
          else cluster.intra_node_gbs) * GB
    ring = (dp - 1) / dp
    all_reduce = stage == 0 or training.zero.grad_reduce == "all_reduce"
    (fwd_q, _), (bwd_q, bwd_n) = gather_terms(training, prec, stage, dp)
    gather = fwd_q * ring / bw  # ZeRO++: qwZ's int8 bytes; hpZ's backward inside the node
    gather_bwd = (bwd_q * (bwd_n - 1) / bwd_n / (cluster.intra_node_gbs * GB) if bwd_n != dp
                  else bwd_q * ring / bw)
    reduce = prec.grad_bytes * ring * (2 if all_reduce else 1) / bw
    qgz = qgz_setting(training, cluster.gpus_per_node, tp, dp)
    if qgz is not None and stage >= 2:  # intra-node all-to-all, then the inter-node one
        intra, inter = qgz_bytes_per_element(qgz[0], dp, qgz[1])
        reduce = intra / (cluster.intra_node_gbs * GB) + inter / bw
    blk_np = el["block"] - el["block_persistent"]
    u = UnitSeconds(
        block_fwd=comp["block_fwd"] + tps["block_fwd"],
        block_bwd=comp["block_bwd"] + tps["block_bwd"],
        root_fwd=comp["root_fwd"] + tps["root_fwd"], root_bwd=comp["root_bwd"] + tps["root_bwd"],
        gather_block=blk_np * gather,
        gather_root=(el["root"] - el["root_persistent"]) * gather,
        gather_block_bwd=blk_np * gather_bwd,
        gather_root_bwd=(el["root"] - el["root_persistent"]) * gather_bwd,
        reduce_block=blk_np * reduce,
        reduce_tail=(el["root"] + n * el["block_persistent"]) * reduce,
        compute=n * (comp["block_fwd"] + comp["block_bwd"]) + comp["root_fwd"] + comp["root_bwd"],
        tp_exposed=n * (tps["block_fwd"] + tps["block_bwd"]) + tps["root_fwd"] + tps["root_bwd"],
        tp_hidden=n * tps["block_hidden"], tp_ring_hidden=n * tps["block_ring_hidden"],
        offload_block=cpu_bytes / (2 * micro_batches * n) / (cluster.cpu_gbs * GB))
    psi_t = el["block"] * n + el["root"]
    persistent = el["root_persistent"] + n * el["block_persistent"]
    refresh = {0: 0.0, 1: psi_t, 2: psi_t, 3: persistent}[stage] * gather
    optimizer = optimizer_seconds(psi_t, dp, stage, prec, cluster.hbm_gbs, offloaded)
    tail = (el["root"] + el["block"] + n * el["block_persistent"]) / psi_t
    host = offload_seconds(offloaded, prec, cluster, n * comp["block_bwd"] + comp["root_bwd"],
                           min(1.0, tail), n + 1)
    out = step_seconds(u, n, micro_batches, stage, refresh,
                       max(optimizer, host["host_step_s"]), training.zero.overlap_param_gather,
                       training.zero.overlap_comm)
    return with_offload(out, optimizer, host)


def with_offload(out: dict, device_optimizer: float, host: dict) -> dict:
    """``out`` (:func:`step_seconds`, whose ``optimizer_s`` is already the longer of the device
    AdamW and the host step) with the offloaded optimizer's seconds
    (:func:`hybrid.planner.offload.offload_seconds`): ``device_optimizer_s``, ``host_step_s``,
    ``host_adam_s``, ``offload_d2h_s``, ``offload_h2d_s`` (totals) and the exposed gradient
    copy ``offload_exposed_s``, added to ``step_s``."""
    out = dict(out, device_optimizer_s=device_optimizer, host_step_s=host["host_step_s"],
               host_adam_s=host["host_adam_s"], offload_d2h_s=host["d2h_s"],
               offload_h2d_s=host["h2d_s"], offload_exposed_s=host["d2h_exposed_s"])
    out["step_s"] += host["d2h_exposed_s"]
    return out
