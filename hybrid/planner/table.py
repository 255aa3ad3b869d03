"""Text output of the planner's command line: the layout table and the ``--max-model`` rows."""

from __future__ import annotations

from hybrid.devices import GIB, gib_text
from hybrid.flops import num_parameters


def _gb(x: float) -> str:
    return f"{x / GIB:8.2f}"


def plan_text(model, cluster, training, cands, skipped, chosen, fitting_only, device,
              note: str | None = None) -> str:
    """The planner's table: a header naming the model, cluster (``device``: where its memory
    and peak came from), ``note`` (lines: what the plan assumed and where each figure came
    from, the settings a ``--model`` preset gave) and every column,
    one row per candidate layout (only fitting ones with ``fitting_only``), the skipped layouts
    and the chosen one. Sizes in GiB (2^30 bytes).
    """
    host_gib = gib_text(cluster.host_memory_bytes / GIB)
    lines = [
        f"model: {model.num_layers} layers, h={model.hidden_size}, "
        f"heads={model.num_attention_heads}, f={model.ffn_hidden_size}, V={model.vocab_size}, "
        f"{num_parameters(model) / 1e9:.3f}B params (unpadded)",
        f"cluster: {cluster.num_gpus} GPUs ({cluster.gpus_per_node}/node) x {device}: "
        f"{cluster.gpu_memory_bytes / GIB:.2f} GiB, peak {cluster.peak_tflops:g} TFLOP/s x "
        f"{cluster.efficiency:g}; s={training.seq_length}, b={_sizes(cands, training)}, "
        f"{training.zero.precision} ({training.accounting} accounting); host {host_gib} GiB DRAM "
        f"per node at {cluster.host_memory_gbs:g} GB/s x {cluster.host_efficiency:g}, PCIe "
        f"{cluster.cpu_gbs:g} GB/s one way per GPU",
        *([note] if note else []),
        "per-rank GiB (2^30 B): total = params + grads + master + optim + activ + temps + buffers "
        f"+ reserve (--reserved-gib {gib_text(cluster.reserved_bytes / GIB)}: CUDA context, "
        "fragmentation); "
        "fit = total <= GPU memory (hst: the host memory per node is exceeded); activ = what "
        "backward keeps, temps = the step's temporaries "
        "(loss logits, a unit's 16-bit gradients, SP's gathered inputs: hybrid.planner."
        "temporaries)",
        "z = ZeRO stage; m = micro-batches per step (gradient accumulation: global batch / "
        "(b * dp)); dpGiB, tpGiB = GiB each rank sends per step; step_s in s (compute + "
        "exposed: hybrid.planner.step_time); b = micro-batch size; exp_s = exposed s; off = "
        "share of the optimizer on the host (ZeRO-Offload: hybrid.planner.offload), hostGiB = "
        "what a node keeps there",
        f"{'tp':>3} {'dp':>4} {'z':>1} {'activation':<11} {'m':>3} {'params':>8} {'grads':>8} "
        f"{'master':>8} {'optim':>8} {'activ':>8} {'temps':>8} {'buffers':>8} {'reserve':>8} "
        f"{'total':>8} fit "
        f"{'dpGiB':>8} {'tpGiB':>8} {'step_s':>9} {'MFU':>5} {'b':>3} {'exp_s':>8} "
        f"{'off':>4} {'hostGiB':>8}",
    ]
    lines += [_row(c, cluster) for c in cands if c.fits or not fitting_only]
    lines += [f"skipped {r}" for r in skipped]
    lines += host_refusal_lines(cands, cluster)
    if chosen is None:
        lines.append("best: nothing fits in memory")
    else:
        lines += best_lines(chosen)
    if training.dropout:
        lines.append("note: with dropout, activ counts the explicit attention core's s^2 terms "
                     "(CPU's path); a GPU runs attention dropout in the fused kernel, which keeps "
                     "none: there activ is an upper bound and selective recompute has nothing to "
                     "recompute")
    return "\n".join(lines)


def _row(c, cluster) -> str:
    """One candidate's row of the table (the columns of :func:`plan_text`'s header)."""
    s = c.model_states
    return (
        f"{c.tp:>3} {c.dp:>4} {c.stage:>1} {c.activation:<11} {c.micro_batches:>3} "
        f"{_gb(s['params'])} {_gb(s['grads'])} {_gb(s['master'])} {_gb(s['optimizer'])} "
        f"{_gb(c.activations['gpu'])} {_gb(c.temporaries['total'])} {_gb(c.buffers)} "
        f"{_gb(cluster.reserved_bytes)} "
        f"{_gb(c.total_bytes)} "
        f"{_fit(c)} {_gb(c.dp_bytes)} {_gb(c.tp_bytes)} "
        f"{c.times['step_s']:9.3f} {c.mfu:5.1%} {c.micro_batch_size:>3} "
        f"{c.times['exposed_s']:8.3f} {c.offload_fraction:4.2g} {_gb(c.host_bytes['node'])}"
    )


def _fit(c) -> str:
    """The fit column: ``yes``, `` no`` (GPU memory) or ``hst`` (host memory only)."""
    return "yes" if c.fits else " no" if not c.device_fits else "hst"


def host_refusal_lines(cands, cluster) -> list[str]:
    """One line on the layouts refused for host memory alone (they fit the GPU), naming the
    limit and the smallest host need among them; [] when none is."""
    refused = [c for c in cands if c.device_fits and not c.host_fits]
    if not refused:
        return []
    least = min(c.host_bytes["node"] for c in refused) / GIB
    return [f"refused {len(refused)} layouts that fit the GPU: their host bytes per node exceed "
            f"--host-memory-gib {gib_text(cluster.host_memory_bytes / GIB)} (the least of them "
            f"needs {least:.2f} GiB: gpus per node x (offloaded optimizer + P_a+cpu "
            "checkpoints))"]


def _sizes(cands, training) -> str:
    """The micro-batch sizes the table holds: ``1`` or ``1,2,4 (searched)``."""
    sizes = sorted({c.micro_batch_size for c in cands}) or [training.micro_batch_size]
    return ",".join(map(str, sizes)) + (" (searched)" if len(sizes) > 1 else "")


def best_lines(chosen) -> list[str]:
    """The chosen layout and its step: compute + each exposed term and why it is exposed
    (``Candidate.times``, :mod:`hybrid.planner.step_time`), seconds per step."""
    t = chosen.times
    optimizer = ("the longer of the GPU's AdamW and the host step, below" if
                 chosen.offload_fraction else "HBM-bound AdamW")
    return [
        f"best: tp={chosen.tp} dp={chosen.dp} zero={chosen.stage} "
        f"activation={chosen.activation} micro-batch={chosen.micro_batch_size} "
        f"(m={chosen.micro_batches}) total {chosen.total_bytes / GIB:.2f} GiB/rank, step "
        f"{t['step_s']:.3f} s = compute {t['compute_s']:.3f} + exposed {t['exposed_s']:.3f}, "
        f"{chosen.tokens_per_s:,.0f} tokens/s, MFU {chosen.mfu:.1%}",
        f"  exposed s: tp {t['tp_exposed_s']:.3f} (collectives on the compute stream; SP's "
        f"backward{_rings(t)} hides {t['tp_hidden_s']:.3f} of {t['tp_s']:.3f}) + dp "
        f"{t['dp_exposed_s']:.3f} of {t['dp_s']:.3f} (first gather {t['first_gather_s']:.3f}, "
        f"last reduce {t['last_reduce_s']:.3f}: nothing to overlap; beyond the compute they "
        f"overlap {t['unhidden_dp_s']:.3f}; refresh after the step {t['refresh_s']:.3f}) + "
        f"optimizer {t['optimizer_s']:.3f} ({optimizer}) + cpu {t['cpu_exposed_s']:.3f} of "
        f"{t['cpu_s']:.3f} (P_a+cpu: the first checkpoint load of each backward, copies beyond "
        "the compute)",
        *offload_lines(chosen),
    ]


def offload_lines(c) -> list[str]:
    """The chosen layout's host memory and, when it offloads, the offloaded optimizer's step
    (:mod:`hybrid.planner.offload`): bytes in GiB, seconds per step."""
    h, t = c.host_bytes, c.times
    lines = [f"  host: {h['node'] / GIB:.2f} GiB per node = gpus per node x "
             f"({h['states'] / GIB:.2f} offloaded optimizer + {h['checkpoints'] / GIB:.2f} "
             "P_a+cpu checkpoints) GiB"]
    if c.offload_fraction:
        lines.append(
            f"  optimizer offload {c.offload_fraction:g} of the partition (--optimizer-cpu-"
            f"offload --optimizer-offload-fraction {c.offload_fraction:g}): optimizer "
            f"{t['optimizer_s']:.3f} s = max(device AdamW {t['device_optimizer_s']:.3f}, host "
            f"step {t['host_step_s']:.3f} = host AdamW {t['host_adam_s']:.3f} pipelined with "
            f"the parameters' copy up {t['offload_h2d_s']:.3f}); gradients' copy down "
            f"{t['offload_d2h_s']:.3f}, exposed {t['offload_exposed_s']:.3f} (beyond the last "
            "backward)")
    return lines


def _rings(t: dict) -> str:
    """`` and --tp-comm-overlap's rings (R s of it)`` when they hide anything, else nothing."""
    r = t.get("tp_ring_hidden_s", 0.0)
    return (f" and --tp-comm-overlap's rings (forward, gradient gathers: {r:.3f} s of it)"
            if r else "")


def max_model_text(rows: list[dict], budget_bytes: float | None = None) -> str:
    """``--max-model`` rows (from ``cli._max_model``) as text, parameters in billions; the
    header names the per-GPU budget (memory less the reserve, bytes) in GiB."""
    budget = "" if budget_bytes is None else f" of {budget_bytes / GIB:.2f} GiB"
    lines = [
        f"largest model per GPU budget{budget} (GPU memory less --reserved-gib; model states "
        "only = ZeRO Table 2; with activations = largest layer count of the given width)"
    ]
    for r in rows:
        line = (f"tp={r['tp']:>2} dp={r['dp']:>5} zero={r['stage']}: "
                f"{r['max_params_model_states'] / 1e9:9.2f}B")
        if r.get("max_params_offloaded") is not None:
            line += f" (optimizer on the host: {r['max_params_offloaded'] / 1e9:.2f}B)"
        if "max_layers" in r:
            line += "  | " + ", ".join(
                f"{a}: {n} layers ({r['max_params_with_activations'][a] / 1e9:.1f}B)"
                for a, n in r["max_layers"].items()
            )
        lines.append(line)
    return "\n".join(lines)
