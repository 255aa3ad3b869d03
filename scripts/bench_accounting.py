"""Measured model-state bytes and data-parallel bytes per step against the planner's prediction.

Not a test (``tests/test_plan_vs_engine.py`` asserts the same on a smaller model). One world of
``--world`` ranks (gloo on CPU) runs every configuration of ``hybrid.dryrun.check.default_runs``
for one optimizer step: ZeRO stages 0-3 x (tp, dp) in {(1, world), (2, world/2)} x bf16/fp32 x
1 and 2 micro-batches, plus stage 3 with persistent biases / LayerNorms. The planner is
``hybrid.planner.plan.evaluate`` with ``accounting="engine"``. Prints a table, writes
``accounting.md``, ``accounting.json`` and ``accounting.png`` under ``--out``.

    python scripts/bench_accounting.py                            # h=256, 4 layers, world 4
    python scripts/bench_accounting.py --hidden-size 128 --num-layers 2 --out runs/bench

Env: none. Bytes are per rank; traffic is what one rank sends per optimizer step (ring volume).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hybrid.dryrun.check import compare, default_runs, measure_world, predict  # noqa: E402
from hybrid.parallel.spawn import spawn_world  # noqa: E402

MIB = 2**20


def rows_of(runs, measured: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        pred = predict(run)
        # Every rank of a layout holds the same layout; take the worst error over ranks.
        errs = [compare(pred, m[run.name]) for m in measured]
        meas = measured[0][run.name]
        rows.append(dict(
            run=run.name, stage=run.stage, tp=run.tp, dp=run.dp, precision=run.precision,
            micro_batches=run.micro_batches, persist=run.zero.param_persistence_threshold,
            state_pred=pred["states"]["total"], state_meas=meas["states"]["total"],
            state_err=max((e["states.total"] for e in errs), key=abs),
            state_err_max_key=max((abs(v) for e in errs for k, v in e.items()
                                   if k.startswith("states.")), default=0.0),
            dp_pred=pred["dp_total"], dp_meas=meas["dp_total"],
            dp_err=max((e["dp_total"] for e in errs), key=abs),
            dp_pred_kinds=pred["dp"], dp_meas_kinds=meas["dp"],
            states_pred=pred["states"], states_meas=meas["states"]))
    return rows


def table(rows: list[dict]) -> str:
    head = ("| run | states pred MiB | states meas MiB | err | worst per-kind err | "
            "DP pred MiB/step | DP meas MiB/step | err |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['state_pred'] / MIB:.3f} | {r['state_meas'] / MIB:.3f} | "
            f"{r['state_err']:+.3%} | {r['state_err_max_key']:.3%} | {r['dp_pred'] / MIB:.3f} | "
            f"{r['dp_meas'] / MIB:.3f} | {r['dp_err']:+.3%} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.45 * len(rows)), 8), sharex=True)
    for ax, key, title in ((axes[0], "state", "model-state bytes per rank"),
                           (axes[1], "dp", "data-parallel bytes per rank per step")):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[f"{key}_meas"] / MIB for r in rows], 0.4,
               label="measured (engine)")
        ax.bar([i + 0.2 for i in x], [r[f"{key}_pred"] / MIB for r in rows], 0.4,
               label="planner (engine accounting)")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.legend()
    axes[1].set_xticks(list(range(len(rows))))
    axes[1].set_xticklabels(names, rotation=75, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    if args.world % 2:
        raise SystemExit("--world must be even (the tp=2 layouts need it)")
    model = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                 num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                 max_position_embeddings=args.seq_length)
    runs = default_runs(model, args.world)
    runs = [r.__class__(**{**r.__dict__, "seq_length": args.seq_length}) for r in runs]
    t0 = time.time()
    measured = spawn_world(args.world, measure_world, runs, timeout_s=300)
    wall = time.time() - t0
    rows = rows_of(runs, measured)
    text = table(rows)
    worst_state = max(abs(r["state_err_max_key"]) for r in rows)
    worst_dp = max(abs(r["dp_err"]) for r in rows)
    summary = (f"{len(rows)} runs, world {args.world}, model {model}, seq {args.seq_length}; "
               f"worst model-state error {worst_state:.3%} (any key), worst DP-traffic error "
               f"{worst_dp:.3%}; {wall:.0f} s")
    print(text)
    print(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accounting.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "accounting.png")
    (out / "accounting.md").write_text(
        "# Planner vs ZeroEngine: model-state bytes and DP bytes per step\n\n"
        f"`python scripts/bench_accounting.py {' '.join(sys.argv[1:])}`\n\n{summary}.\n\n"
        "Planner: `hybrid.planner.plan.evaluate(..., Training(accounting='engine'))`. Measured: "
        "`engine.memory_bytes()` (params + grads + master + optimizer) and the step's ledger "
        "(all_reduce + reduce_scatter + all_gather; the 16-byte norm all-reduce excluded). "
        "Errors are (planner - measured) / measured, worst over ranks; the only difference is "
        "the layout's padding of each unit to a multiple of dp * 8 elements.\n\n"
        f"{text}\n\n![accounting](accounting.png)\n")
    print(f"wrote {out / 'accounting.md'}, {out / 'accounting.png'}")


if __name__ == "__main__":
    main()
