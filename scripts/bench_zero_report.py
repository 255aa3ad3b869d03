"""bench_zero's report: the median launch per configuration, our ms/step over each peer's, the
markdown table, the ratio plot and the printed table (imported by ``scripts/bench_zero.py``)."""

from __future__ import annotations

import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def merge_repeats(rs: list[dict]) -> dict:
    """The launch with the median ms/step, plus ``ms_repeats`` (every launch's median ms/step)
    and ``profile_ms`` as the per-phase median over launches."""
    rs = sorted(rs, key=lambda r: r["ms_step_median"])
    out = dict(rs[(len(rs) - 1) // 2])
    out["ms_repeats"] = [r["ms_step_median"] for r in rs]
    profs = [r["profile_ms"] for r in rs if "profile_ms" in r]
    if profs:
        keys = dict.fromkeys(k for p in profs for k in p)
        out["profile_ms"] = {k: statistics.median(p.get(k, 0.0) for p in profs) for k in keys}
    return out


def _peer_of_stage(name: str) -> str:
    return f"deepspeed_z{name[8]}"


def ratios(results: dict) -> dict:
    """{our config: {peer: our ms/step / peer ms/step}} for DDP, FSDP2 and DeepSpeed of the
    same stage (below 1: we are faster)."""
    out = {}
    for name, r in results.items():
        if not name.startswith("hybrid_z") or name.endswith("_floor"):
            continue
        out[name] = {}
        for peer in ("ddp", "fsdp2", "fsdp2_noreshard", "tp2d", _peer_of_stage(name),
                     name + "_floor"):
            p = results.get(peer)
            if p is not None:
                key = ("deepspeed (same stage)" if peer.startswith("deepspeed") else
                       "compute-only floor" if peer.endswith("_floor") else peer)
                out[name][key] = r["ms_step_median"] / p["ms_step_median"]
    return out


def write_report(results: dict, out: Path, args, steps: int, warmup: int,
                 launches: dict | None = None) -> None:
    """Markdown tables (the targets' verdicts over launch pairs when ``launches``, every run,
    our ms/step over each peer's, the phase profile, the floor) and a PNG of the ratios.

    Args:
        launches: ``{config: [round 0's result or None, ...]}`` (``scripts/bench_zero.py``).
    """
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"throughput_{args.size}_w{args.world}"
    lines = []
    if launches:
        from bench_zero_targets import targets_table

        rounds = max(len(v) for v in launches.values())
        lines += [f"Targets: the peer's ms/step over ours (above 1: we are faster), per round of "
                  f"launches ({rounds}), median and min-max; met only when every round clears "
                  f"the target:", ""]
        lines += targets_table(launches, results, getattr(args, "skipped", {})) + [""]
    lines += ["| config | dp | ms/step | spread (launches) | tokens/s | peak RSS MiB | state MiB | "
             "loss end |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        reps = r.get("ms_repeats", [r["ms_step_median"]])
        spread = f"{min(reps):.0f}-{max(reps):.0f} ({len(reps)})"
        lines.append(f"| {name} | {r['dp']} | {r['ms_step_median']:.1f} | {spread} | "
                     f"{r['tokens_per_s']:.0f} | {max(r['peak_rss_mib_per_rank']):.0f} | "
                     f"{max(r['state_mib_per_rank'] or [0]):.1f} | {r['loss_final']:.4f} |")
    rat = {n: v for n, v in ratios(results).items() if v}
    peers = sorted({p for v in rat.values() for p in v})
    if rat:
        lines += ["", "Our ms/step divided by the peer's (below 1: we are faster):", "",
                  "| ours | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
    for name, v in rat.items():
        lines.append(f"| {name} | " + " | ".join(f"{v[p]:.2f}" if p in v else "-" for p in peers)
                     + " |")
    prof = {n: r["profile_ms"] for n, r in results.items() if "profile_ms" in r}
    if prof:
        sys.path.insert(0, str(REPO))
        from hybrid.zero.profile import format_profile

        lines += ["", "Per-phase profile of rank 0, ms per timed step (exclusive times; "
                  "`hybrid.zero.profile`; `_floor`: every data-parallel collective skipped):", ""]
        lines += format_profile(prof)
    alone = {n: r for n, r in results.items()
             if "dp_collectives_alone_ms" in r and n + "_floor" in results}
    if alone:
        lines += ["", "Step against its compute-only floor plus the same step's data-parallel "
                  "collectives replayed alone (synchronous, no compute; "
                  "`hybrid.zero.comm.replay`). A ratio near 1: the step costs exactly its compute "
                  "plus its collectives, so on this machine, where the ranks' cores are all busy "
                  "computing, only fewer bytes (not overlap) could make it faster:",
                  "", "| config | ms/step | floor | collectives alone (count) | floor + "
                  "collectives | step / (floor + collectives) |", "|---|---|---|---|---|---|"]
        for n, r in alone.items():
            fl, co = results[n + "_floor"]["ms_step_median"], r["dp_collectives_alone_ms"]
            lines.append(f"| {n} | {r['ms_step_median']:.1f} | {fl:.1f} | {co:.1f} "
                         f"({r['dp_collectives_per_step']}) | {fl + co:.1f} | "
                         f"{r['ms_step_median'] / (fl + co):.2f} |")
    head = (f"# Throughput vs peers ({args.size}, world {args.world}, {steps} steps, {warmup} "
            f"warm-up)\n\n`python scripts/bench_zero.py {shlex.join(sys.argv[1:])}`\n\nours: "
            f"grad_reduce {args.grad_reduce}, reduce bucket {args.reduce_bucket_size} elements, "
            + ("gloo's native collectives" if args.native_collectives else
               "gloo's reduce-scatter as all-to-all + sum and large all-gathers as broadcasts "
               "(`hybrid.zero.comm`)") + ". "
            "fp32, gloo, "
            "OMP_NUM_THREADS=1; every round launches each configuration once, in sequence "
            "(run-to-run noise on a shared 2-core VM is 15-25%, hence ratios per round).\n\n")
    picture = _plot_ratios(rat, peers, stem, args) if rat else None
    if rat and picture is None:
        print("note: matplotlib is not installed, so no ratio plot was drawn "
              "(pip install hybrid-zero[plot]); the table above and the markdown report are "
              "complete")
    tail = f"\n\n![ratios]({picture.name})\n" if picture is not None else "\n"
    stem.with_suffix(".md").write_text(head + "\n".join(lines) + tail)
    print(f"wrote {stem}.md")


def _plot_ratios(rat: dict, peers: list[str], stem: Path, args) -> Path | None:
    """Bar chart of our ms/step over each peer's; None (nothing drawn) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(peers))
    for j, p in enumerate(peers):
        xs = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(rat))]
        ax.bar(xs, [v.get(p, 0) for v in rat.values()], width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rat)))
    ax.set_xticklabels(list(rat))
    ax.set_ylabel("our ms/step / peer ms/step")
    ax.set_title(f"throughput ratios, {args.size}, world {args.world} (below 1: faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(f"{stem}_ratios.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(results: dict) -> None:
    head = (f"{'config':<18} {'dp':>3} {'ms/step':>8} {'tok/s':>8} {'RSS MiB':>8} {'state MiB':>9} "
            f"{'loss_end':>8} | {'t/ddp':>6} {'t/fsdp2':>7} {'t/ds':>6} {'RSS/ds':>6} "
            f"{'state/ds':>8}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        rss, state = max(r["peak_rss_mib_per_rank"]), max(r["state_mib_per_rank"] or [0])
        row = (f"{name:<18} {r['dp']:>3} {r['ms_step_median']:>8.1f} {r['tokens_per_s']:>8.0f} "
               f"{rss:>8.0f} {state:>9.1f} {r['loss_final']:>8.4f}")
        if name.startswith("hybrid_z"):
            def ratio(peer, key="ms_step_median", r=r):
                p = results.get(peer)
                if p is None:
                    return "-"
                if key == "rss":
                    return (
                        f"{max(r['peak_rss_mib_per_rank']) / max(p['peak_rss_mib_per_rank']):.2f}")
                if key == "state":
                    return f"{max(r['state_mib_per_rank']) / max(p['state_mib_per_rank']):.2f}"
                return f"{r[key] / p[key]:.2f}"
            ds = f"deepspeed_z{name[8]}"
            row += (f" | {ratio('ddp'):>6} {ratio('fsdp2'):>7} {ratio(ds):>6} "
                    f"{ratio(ds, 'rss'):>6} {ratio(ds, 'state'):>8}")
        print(row)
    print("t/X = our ms/step / X's ms/step (below 1: we are faster); ds = DeepSpeed ZeRO of the "
          "same stage; RSS and state are per-rank maxima.")

