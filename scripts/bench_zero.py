"""Throughput and memory of our ZeRO stages beside torch DDP, FSDP2 and DeepSpeed, in one run.

Not a test. Every configuration is one ``torchrun --standalone`` launch, in sequence, on the
peers' workload (their ``common.py`` in ``PEERS_DIR``: same model dimensions, seeded synthetic data,
AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1, no clipping, fp32, gloo, OMP_NUM_THREADS=1), and every
launch prints the peers' ``RESULT {json}`` line, so the figures are measured the same way:
ms/step = median of rank 0's timed steps (forward through optimizer step), tokens/s = global
tokens per step / that, RSS = max over ranks of peak RSS, state = max over ranks of bytes in
params + grads + master + optimizer states.

    python scripts/bench_zero.py                       # tiny GPT, world 4
    python scripts/bench_zero.py --size medium --world 2 --peers "ddp fsdp2 deepspeed_z3"

Each of our configurations also runs as ``<name>_floor``: the same ranks and model with every
data-parallel collective skipped (``DPComm.skip_collectives``), the compute-only floor of this
machine; and ours report a per-phase profile of rank 0's timed steps (``hybrid.zero.profile``:
forward, backward, hooks, copies, grad_comm, param_gather, grad_norm, optimizer, refresh,
zeroing). ``--repeats N`` launches everything N times, interleaved, and reports the median launch
with the spread.

Writes ``throughput_<size>_w<world>.md`` (the tables: throughput with spread, ratios against the
peers and the floor, the phase profile) and ``..._ratios.png`` under ``--out`` (default runs/bench).

Env: PEERS_DIR (default ../shared/peers next to this repository), PEERS_VENV (default
${TMPDIR:-/tmp}/hybrid-peers-venv, built by the peers' setup.sh; needed for DeepSpeed).
Differences from the peers: our GPT fuses q/k/v into one Linear (same parameter count) and,
following Megatron, does not decay biases and LayerNorm weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PEERS_DIR", REPO.parent / "shared" / "peers")).resolve()


def worker(stage: int, tp: int, floor: bool, profile: bool) -> None:
    """One of our configurations, under torchrun (reports like the peers). ``floor``: every
    data-parallel collective skipped (the compute-only floor); ``profile``: per-phase times of
    rank 0's timed steps in the result (``profile_ms``)."""
    sys.path[:0] = [str(REPO), str(PEERS)]
    import common as C  # the peers' workload and reporting
    import torch

    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from hybrid.zero.profile import NULL_TIMER, PhaseTimer
    from models.gpt import GPT, GPTConfig

    rank, world = C.init_dist()
    size, c = C.cfg_from_env()
    steps = int(os.environ.get("PEER_STEPS", "23"))
    warmup = int(os.environ.get("PEER_WARMUP", "3"))
    grid = ProcessGrid(tp=tp)
    torch.manual_seed(1234)
    model = GPT(GPTConfig(num_layers=c.layers, hidden_size=c.hidden, num_attention_heads=c.heads,
                          vocab_size=c.vocab, max_position_embeddings=c.seq, hidden_dropout=0.0,
                          attention_dropout=0.0, untie_embeddings_and_output_weights=True))
    grad_reduce = os.environ.get("HYBRID_GRAD_REDUCE", "reduce_scatter")
    bucket = int(os.environ.get("HYBRID_REDUCE_BUCKET", "50000000"))
    engine = parallelize(model, grid, PretrainConfig(
        zero=ZeroConfig(stage=stage, precision="fp32", grad_reduce=grad_reduce, reduce_bucket_size=bucket),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                  clip_grad=0.0)))
    engine.comm.skip_collectives = floor
    engine.comm.composed &= os.environ.get("HYBRID_NATIVE_COLLECTIVES") != "1"
    timer = PhaseTimer(grid.device) if profile else NULL_TIMER
    engine.set_profiler(timer)
    torch.distributed.barrier()
    t_init = time.time() - C.T_PROC_START
    times, losses, state = [], [], None
    recorded: list = []
    for step in range(steps):
        if step == warmup and profile:
            timer.reset()
        engine.comm.recorder = recorded if step == warmup and not floor else None
        x, y = C.batch(c, step, grid.dp_rank)
        t0 = time.perf_counter()
        with timer.phase("forward"):
            loss = engine.model(x, y).mean()
        engine.backward(loss, is_last_micro_batch=True)
        if step == steps - 1:
            m = engine.memory_bytes()
            state = m["params"] + m["grads"] + m["master"] + m["optimizer"]
        engine.step(1e-3)
        times.append(time.perf_counter() - t0)
        timer.end_step() if profile else None
        losses.append(loss.item())
    engine.comm.recorder = None
    lt = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(lt)
    name = f"hybrid_z{stage}" + (f"_tp{tp}" if tp > 1 else "") + ("_floor" if floor else "")
    extra = {"memory_bytes_rank0": engine.memory_bytes()}
    if profile:
        extra["profile_ms"] = {k: round(v, 2) for k, v in timer.per_step_ms().items()}
    if recorded:  # the data-parallel collectives of one step again, with no compute around them
        from hybrid.zero.comm import replay

        extra["dp_collectives_alone_ms"] = round(1e3 * statistics.median(replay(engine.comm, recorded, 5)), 2)
        extra["dp_collectives_per_step"] = len(recorded)
    C.report(name, rank, world, grid.dp_size, c, times, warmup, (lt / world).tolist(), t_init, state,
             extra=extra)
    torch.distributed.destroy_process_group()


def launch(name: str, cmd: list[str], cwd: Path, env: dict, logdir: Path) -> dict | None:
    env = dict(env, PEER_T0=f"{time.time():.6f}")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    (logdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall_s"] = round(time.time() - t0, 1)
            return res
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    # torchrun ends with a box of '=' lines: show the exception itself
    errors = [ln for ln in lines if re.search(r"\w(Error|Exception): ", ln) and "ChildFailedError" not in ln]
    first = (errors or lines[-1:] or ["no output"])[0]
    print(f"# {name}: FAILED ({first[:200]}; log {logdir / (name + '.log')})", flush=True)
    return None


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (``--worker`` and ``--floor`` are for its own launches)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: 23 tiny, 6 medium")
    ap.add_argument("--warmup", type=int, default=None, help="default: 3 tiny, 1 medium")
    ap.add_argument("--stages", default="1 2 3",
                    help="our ZeRO stages (0-3), space- or comma-separated")
    ap.add_argument("--tp", default="1 2", help="our tensor-parallel sizes, each dividing --world "
                                                "(dp = world / tp), space- or comma-separated")
    ap.add_argument("--peers", default="ddp fsdp2 fsdp2_noreshard tp2d deepspeed_z1 deepspeed_z2 "
                                       "deepspeed_z3")
    ap.add_argument("--venv", default=os.environ.get(
        "PEERS_VENV", f"{os.environ.get('TMPDIR', '/tmp')}/hybrid-peers-venv"))
    ap.add_argument("--logdir", default=None, help="every launch's log and results.jsonl (default: "
                                                   "<--out>/logs)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"), help="markdown + PNG report dir")
    ap.add_argument("--no-profile", action="store_true", help="no per-phase profile of ours")
    ap.add_argument("--grad-reduce", default="reduce_scatter",
                    choices=["reduce_scatter", "all_reduce"], help="our ZeroConfig.grad_reduce")
    ap.add_argument("--native-collectives", action="store_true",
                    help="ours with gloo's own reduce-scatter and all-gather instead of the "
                         "composed ones (hybrid.zero.comm: all-to-all + sum, broadcasts)")
    ap.add_argument("--reduce-bucket-size", type=int, default=50_000_000,
                    help="our ZeroConfig.reduce_bucket_size (elements)")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the compute-only floor runs (ours with every dp collective skipped)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="launch each configuration this many times (interleaved); the table "
                         "shows the median and the min-max spread of the per-launch medians")
    ap.add_argument("--worker", nargs=2, type=int, metavar=("STAGE", "TP"), help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turn ``--stages``/``--tp`` into lists and refuse what cannot run (argparse errors)."""
    args.stages, args.tp = _int_list(ap, "--stages", args.stages), _int_list(ap, "--tp", args.tp)
    if args.world < 1:
        ap.error(f"--world {args.world}: give 1 or more ranks")
    if bad := [s for s in args.stages if s not in (0, 1, 2, 3)]:
        ap.error(f"--stages: {bad[0]} is no ZeRO stage; give values from 0 to 3")
    if bad := [t for t in args.tp if t < 1 or args.world % t]:
        ap.error(f"--tp {bad[0]}: a tensor-parallel size must divide --world {args.world}")
    if not (PEERS / "common.py").is_file():
        ap.error(f"the peers' workload {PEERS / 'common.py'} is missing (our runs use its model, "
                 "data and reporting too); set PEERS_DIR to the folder holding common.py")
    if args.peers.split() and not Path(args.venv, "bin", "torchrun").is_file():
        ap.error(f"--venv {args.venv}: no bin/torchrun there; build the peers' environment with "
                 f"{PEERS / 'setup.sh'} (PEERS_VENV), or run ours only with --peers ''")
    args.logdir = args.logdir or str(Path(args.out) / "logs")


def _runs(args: argparse.Namespace) -> list[tuple[str, list[str], Path]]:
    """``(name, command, working directory)`` of every launch: the peers, then ours by tp and
    stage, each followed by its compute-only floor unless ``--no-floor``."""
    n = str(args.world)
    torchrun = [f"{args.venv}/bin/torchrun", "--standalone", "--nproc-per-node", n]
    runs: list[tuple[str, list[str], Path]] = []
    for p in args.peers.split():
        if p.startswith("deepspeed_z"):
            runs.append((p, torchrun + ["peer_deepspeed.py", p[-1]], PEERS))
        else:
            runs.append((p, torchrun + ["peer_torch.py", p], PEERS))
    ours = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n]
    for tp in args.tp:
        for s in args.stages:
            name = f"hybrid_z{s}" + (f"_tp{tp}" if tp > 1 else "")
            cmd = ours + [str(Path(__file__).resolve()), "--worker", str(s), str(tp)]
            cmd += ["--no-profile"] if args.no_profile else []
            runs.append((name, cmd, REPO))
            if not args.no_floor:
                runs.append((name + "_floor", cmd + ["--floor"], REPO))
    return runs


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, floor=args.floor, profile=not args.no_profile)
    _check_args(ap, args)
    steps = args.steps or (6 if args.size == "medium" else 23)
    warmup = args.warmup if args.warmup is not None else (1 if args.size == "medium" else 3)
    env = dict(os.environ, PEER_SIZE=args.size, PEER_STEPS=str(steps), PEER_WARMUP=str(warmup),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", PEER_TP="2", HYBRID_GRAD_REDUCE=args.grad_reduce,
               HYBRID_NATIVE_COLLECTIVES=str(int(args.native_collectives)),
               HYBRID_REDUCE_BUCKET=str(args.reduce_bucket_size))
    logdir = Path(args.logdir) / args.size
    logdir.mkdir(parents=True, exist_ok=True)
    runs = _runs(args)
    print(f"# size={args.size} world={args.world} steps={steps} warmup={warmup} logs={logdir}",
          flush=True)
    launches: dict[str, list] = {}
    for rep in range(args.repeats):
        for name, cmd, cwd in runs:
            res = launch(name, cmd, cwd, env, logdir)
            if res is not None:
                launches.setdefault(name, []).append(res)
                print(f"# {name} [{rep + 1}/{args.repeats}]: {res['ms_step_median']} ms/step",
                      flush=True)
    results = {name: merge_repeats(rs) for name, rs in launches.items()}
    with open(logdir / "results.jsonl", "w") as f:
        for r in results.values():
            f.write(json.dumps(r) + "\n")
    print_table(results)
    write_report(results, Path(args.out), args, steps, warmup)
    if failed := [name for name, _, _ in runs if name not in results]:
        sys.exit(f"failed: {', '.join(failed)} (logs in {logdir})")


def _int_list(ap, flag: str, text: str) -> list[int]:
    """``"1 2"`` or ``"1,2"`` -> ``[1, 2]``; an argparse error names the flag otherwise."""
    try:
        out = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        ap.error(f"{flag} {text!r}: give whole numbers separated by spaces or commas")
    if not out:
        ap.error(f"{flag}: give at least one value")
    return out


def merge_repeats(rs: list[dict]) -> dict:
    """The launch with the median ms/step, plus ``ms_repeats`` (every launch's median ms/step)
    and ``profile_ms`` as the per-phase median over launches."""
    rs = sorted(rs, key=lambda r: r["ms_step_median"])
    out = dict(rs[(len(rs) - 1) // 2])
    out["ms_repeats"] = [r["ms_step_median"] for r in rs]
    profs = [r["profile_ms"] for r in rs if "profile_ms" in r]
    if profs:
        out["profile_ms"] = {k: statistics.median(p.get(k, 0.0) for p in profs) for k in profs[0]}
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
        for peer in ("ddp", "fsdp2", "fsdp2_noreshard", "tp2d", _peer_of_stage(name), name + "_floor"):
            p = results.get(peer)
            if p is not None:
                key = ("deepspeed (same stage)" if peer.startswith("deepspeed") else
                       "compute-only floor" if peer.endswith("_floor") else peer)
                out[name][key] = r["ms_step_median"] / p["ms_step_median"]
    return out


def write_report(results: dict, out: Path, args, steps: int, warmup: int) -> None:
    """Markdown table (every run, then our ms/step over each peer's) and a PNG of the ratios."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"throughput_{args.size}_w{args.world}"
    lines = ["| config | dp | ms/step | spread (launches) | tokens/s | peak RSS MiB | state MiB | loss end |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        reps = r.get("ms_repeats", [r["ms_step_median"]])
        spread = f"{min(reps):.0f}-{max(reps):.0f} ({len(reps)})"
        lines.append(f"| {name} | {r['dp']} | {r['ms_step_median']:.1f} | {spread} | {r['tokens_per_s']:.0f} | "
                     f"{max(r['peak_rss_mib_per_rank']):.0f} | {max(r['state_mib_per_rank'] or [0]):.1f} | "
                     f"{r['loss_final']:.4f} |")
    rat = {n: v for n, v in ratios(results).items() if v}
    peers = sorted({p for v in rat.values() for p in v})
    if rat:
        lines += ["", "Our ms/step divided by the peer's (below 1: we are faster):", "",
                  "| ours | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
    for name, v in rat.items():
        lines.append(f"| {name} | " + " | ".join(f"{v[p]:.2f}" if p in v else "-" for p in peers) + " |")
    prof = {n: r["profile_ms"] for n, r in results.items() if "profile_ms" in r}
    if prof:
        sys.path.insert(0, str(REPO))
        from hybrid.zero.profile import format_profile

        lines += ["", "Per-phase profile of rank 0, ms per timed step (exclusive times; "
                  "`hybrid.zero.profile`; `_floor`: every data-parallel collective skipped):", ""]
        lines += format_profile(prof)
    alone = {n: r for n, r in results.items() if "dp_collectives_alone_ms" in r and n + "_floor" in results}
    if alone:
        lines += ["", "Step against its compute-only floor plus the same step's data-parallel collectives "
                  "replayed alone (synchronous, no compute; `hybrid.zero.comm.replay`). A ratio near 1: "
                  "the step costs exactly its compute plus its collectives, so on this machine, where the "
                  "ranks' cores are all busy computing, only fewer bytes (not overlap) could make it faster:",
                  "", "| config | ms/step | floor | collectives alone (count) | floor + collectives | "
                  "step / (floor + collectives) |", "|---|---|---|---|---|---|"]
        for n, r in alone.items():
            fl, co = results[n + "_floor"]["ms_step_median"], r["dp_collectives_alone_ms"]
            lines.append(f"| {n} | {r['ms_step_median']:.1f} | {fl:.1f} | {co:.1f} "
                         f"({r['dp_collectives_per_step']}) | {fl + co:.1f} | {r['ms_step_median'] / (fl + co):.2f} |")
    head = (f"# Throughput vs peers ({args.size}, world {args.world}, {steps} steps, {warmup} warm-up)"
            f"\n\n`python scripts/bench_zero.py {shlex.join(sys.argv[1:])}`\n\nours: grad_reduce "
            f"{args.grad_reduce}, reduce bucket {args.reduce_bucket_size} elements, "
            + ("gloo's native collectives" if args.native_collectives else
               "gloo's reduce-scatter as all-to-all + sum and large all-gathers as broadcasts "
               "(`hybrid.zero.comm`)") + ". "
            "fp32, gloo, "
            "OMP_NUM_THREADS=1, one launch each in sequence; run-to-run noise on this VM is "
            "about 15-25% (the peers' own repeated runs).\n\n")
    picture = _plot_ratios(rat, peers, stem, args) if rat else None
    if rat and picture is None:
        print("note: matplotlib is not installed, so no ratio plot was drawn "
              "(pip install hybrid-zero[plot]); the table above and the markdown report are complete")
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
            f"{'loss_end':>8} | {'t/ddp':>6} {'t/fsdp2':>7} {'t/ds':>6} {'RSS/ds':>6} {'state/ds':>8}")
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
                    return f"{max(r['peak_rss_mib_per_rank']) / max(p['peak_rss_mib_per_rank']):.2f}"
                if key == "state":
                    return f"{max(r['state_mib_per_rank']) / max(p['state_mib_per_rank']):.2f}"
                return f"{r[key] / p[key]:.2f}"
            ds = f"deepspeed_z{name[8]}"
            row += (f" | {ratio('ddp'):>6} {ratio('fsdp2'):>7} {ratio(ds):>6} {ratio(ds, 'rss'):>6} "
                    f"{ratio(ds, 'state'):>8}")
        print(row)
    print("t/X = our ms/step / X's ms/step (below 1: we are faster); ds = DeepSpeed ZeRO of the same "
          "stage; RSS and state are per-rank maxima.")


if __name__ == "__main__":
    main()
