"""Throughput and memory of our ZeRO stages beside torch DDP, FSDP2, DTensor TP x FSDP2 and
DeepSpeed, in one run, from this repository alone.

Not a test. Every configuration is one ``torch.distributed.run --standalone`` launch on the
peers' common workload (``scripts/peers/workload.py``: same model dimensions, seeded synthetic
data, AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1, no clipping, fp32, gloo, OMP_NUM_THREADS=1); the
peers are ``scripts/peers/peer_torch.py`` (ddp, fsdp2, fsdp2_noreshard, tp2d) and
``scripts/peers/peer_deepspeed.py`` (deepspeed_z0..3: ``pip install -e '.[bench]'``; without
DeepSpeed those peers are skipped and the table says why). Every launch prints one
``RESULT {json}`` line, so the figures are measured the same way: ms/step = median of rank 0's
timed steps (forward through optimizer step), tokens/s = global tokens per step / that,
RSS = max over ranks of peak RSS, state = max over ranks of bytes in params + grads + master +
optimizer states.

    python scripts/bench_zero.py --size tiny --world 4 --repeats 3
    python scripts/bench_zero.py --size medium --world 2 --peers "ddp fsdp2 deepspeed_z3"

Each of our configurations also runs as ``<name>_floor``: the same ranks and model with every
data-parallel collective skipped (``DPComm.skip_collectives``), the compute-only floor of this
machine; ours also replay one step's data-parallel collectives alone and report a per-phase
profile of rank 0's timed steps (``hybrid.zero.profile``). ``--repeats k`` runs k rounds, each
launching every configuration once (ours, peer, ours, peer, ...); each ratio is taken per round
and the table gives its median and min-max spread over the rounds, claiming a target only when
the whole spread clears it (``scripts/bench_zero_targets.py``).

``--configs 'z1 z3 z2_tp2'`` picks ours by name; ``--fusion 'on off'`` runs each with
gradient-accumulation fusion and without (``*_nofusion``: the path before issue 33) in the same
rounds; ``--model llama`` runs ours on the same sizes in the Llama shape (no peer has it);
``--overlap-param-gather`` turns that on for ours, ``--kernel-fusion on|off`` sets ours' fused
elementwise kernels (run the two in turn for their ratio).

Writes ``throughput_<size>_w<world>.md`` (the tables and the verdicts) and ``..._ratios.png``
under ``--out`` (default runs/bench).

Differences from the peers: our GPT fuses q/k/v into one Linear (same parameter count) and,
following Megatron, does not decay biases and LayerNorm weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero_report import merge_repeats, print_table, write_report  # noqa: E402

PEERS = REPO / "scripts" / "peers"


def _model_config(c, model: str):
    """The workload's model: the peers' GPT, or (``llama``) the same sizes in the Llama shape
    (RMSNorm, SwiGLU, RoPE, no biases, grouped K/V heads, untied head), which no peer runs."""
    from models.gpt import GPTConfig

    kw = dict(num_layers=c.layers, hidden_size=c.hidden, num_attention_heads=c.heads,
              vocab_size=c.vocab, max_position_embeddings=c.seq, hidden_dropout=0.0,
              attention_dropout=0.0, untie_embeddings_and_output_weights=True)
    if model == "llama":
        kw.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, num_query_groups=max(1, c.heads // 2))
    return GPTConfig(**kw)


def worker(stage: int, tp: int, floor: bool, profile: bool, fusion: bool = True,
           offload: bool = False) -> None:
    """One of our configurations, under torchrun (reports like the peers). ``floor``: every
    data-parallel collective skipped (the compute-only floor); ``profile``: per-phase times of
    rank 0's timed steps in the result (``profile_ms``); ``fusion``: gradient-accumulation
    fusion (``ZeroConfig.gradient_accumulation_fusion``; off is the path before issue 33);
    ``offload``: ``--optimizer-cpu-offload`` (host AdamW on 1 thread, like the rest)."""
    sys.path[:0] = [str(REPO), str(PEERS)]
    import torch
    import workload as C  # the peers' workload and reporting

    from hybrid.config import PretrainConfig
    from hybrid.fusion import FusionConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from hybrid.zero.profile import NULL_TIMER, PhaseTimer
    from models.gpt import GPT

    rank, world = C.init_dist()
    size, c = C.cfg_from_env()
    steps = int(os.environ.get("PEER_STEPS", "23"))
    warmup = int(os.environ.get("PEER_WARMUP", "3"))
    grid = ProcessGrid(tp=tp)
    torch.manual_seed(1234)
    model = GPT(_model_config(c, os.environ.get("HYBRID_MODEL", "gpt")))
    grad_reduce = os.environ.get("HYBRID_GRAD_REDUCE", "reduce_scatter")
    bucket = int(os.environ.get("HYBRID_REDUCE_BUCKET", "50000000"))
    kernels = FusionConfig(kernel_fusion=os.environ.get("HYBRID_KERNEL_FUSION", "auto"))
    engine = parallelize(model, grid, PretrainConfig(
        fusion=kernels,
        zero=ZeroConfig(stage=stage, precision="fp32", grad_reduce=grad_reduce,
                        reduce_bucket_size=bucket, gradient_accumulation_fusion=fusion,
                        overlap_param_gather=stage > 0
                        and os.environ.get("HYBRID_OVERLAP_PARAM_GATHER") == "1",
                        optimizer_cpu_offload=offload, optimizer_cpu_threads=1),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                                  adam_eps=1e-8, clip_grad=0.0)))
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
            state = m["params"] + m["grads"] + m["master"] + m["optimizer"] + m["host_states"]
        engine.step(1e-3)
        times.append(time.perf_counter() - t0)
        timer.end_step() if profile else None
        losses.append(loss.item())
    engine.comm.recorder = None
    lt = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(lt)
    name = (f"hybrid_z{stage}" + (f"_tp{tp}" if tp > 1 else "") + ("" if fusion else "_nofusion")
            + ("_offload" if offload else "") + ("_floor" if floor else ""))
    extra = {"memory_bytes_rank0": engine.memory_bytes()}
    if profile:
        extra["profile_ms"] = {k: round(v, 2) for k, v in timer.per_step_ms().items()}
    if recorded:  # the data-parallel collectives of one step again, with no compute around them
        from hybrid.zero.comm import replay

        extra["dp_collectives_alone_ms"] = round(1e3 * statistics.median(replay(engine.comm,
                                                                                recorded, 5)), 2)
        extra["dp_collectives_per_step"] = len(recorded)
    C.report(name, rank, world, grid.dp_size, c, times, warmup, (lt / world).tolist(), t_init,
             state, extra=extra)
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
    errors = [ln for ln in lines
              if re.search(r"\w(Error|Exception): ", ln) and "ChildFailedError" not in ln]
    first = (errors or lines[-1:] or ["no output"])[0]
    print(f"# {name}: FAILED ({first[:200]}; log {logdir / (name + '.log')})", flush=True)
    return None


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (``--worker`` and ``--floor`` are for its own launches)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "medium", "test"],
                    help="the workload (scripts/peers/workload.py; test: a seconds-long smoke run)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: 15 tiny, 6 medium")
    ap.add_argument("--warmup", type=int, default=None, help="default: 3 tiny, 1 medium")
    ap.add_argument("--stages", default="1 2 3",
                    help="our ZeRO stages (0-3), space- or comma-separated")
    ap.add_argument("--tp", default="1 2", help="our tensor-parallel sizes, each dividing --world "
                                                "(dp = world / tp), space- or comma-separated")
    ap.add_argument("--peers", default="ddp fsdp2 tp2d deepspeed_z1 deepspeed_z2 deepspeed_z3",
                    help="peers (scripts/peers/): ddp, fsdp2, fsdp2_noreshard, tp2d, "
                         "deepspeed_z0..3")
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
                    help="rounds, each launching every configuration once (interleaved); the "
                         "tables give each ratio's median and min-max spread over the rounds")
    ap.add_argument("--configs", default=None,
                    help="only these of ours, e.g. 'z1 z3 z2_tp2' (default: --stages x --tp)")
    ap.add_argument("--fusion", default="on",
                    help="gradient-accumulation fusion of ours: 'on', 'off' (the path before "
                         "issue 33, named *_nofusion) or 'on off' (both, interleaved)")
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"],
                    help="ours on the peers' GPT or on the same sizes in the Llama shape "
                         "(no peer runs that: the peers are skipped)")
    ap.add_argument("--kernel-fusion", default="auto", choices=["auto", "on", "off"],
                    help="ours with this --kernel-fusion (fused elementwise kernels; auto: "
                         "CUDA only, so eager here)")
    ap.add_argument("--overlap-param-gather", action="store_true",
                    help="ours (stages 1-3) with ZeroConfig.overlap_param_gather")
    ap.add_argument("--offload", default="off",
                    help="ours with --optimizer-cpu-offload: 'off', 'on' (named *_offload) or "
                         "'off on' (both, interleaved; the offload/device ratio and the host "
                         "step's share of the step are printed)")
    ap.add_argument("--worker", nargs=2, type=int, metavar=("STAGE", "TP"), help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-fusion", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-offload", action="store_true", help=argparse.SUPPRESS)
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
    known = {"ddp", "fsdp2", "fsdp2_noreshard", "tp2d"} | {f"deepspeed_z{s}" for s in range(4)}
    if bad := [p for p in args.peers.split() if p not in known]:
        ap.error(f"--peers: unknown peer {bad[0]!r}; valid: {', '.join(sorted(known))}")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: give 1 or more rounds")
    args.offload = args.offload.replace(",", " ").split()
    if not args.offload or any(f not in ("on", "off") for f in args.offload):
        ap.error(f"--offload {' '.join(args.offload)!r}: give off, on or 'off on'")
    args.fusion = args.fusion.replace(",", " ").split()
    if not args.fusion or any(f not in ("on", "off") for f in args.fusion):
        ap.error(f"--fusion {' '.join(args.fusion)!r}: give on, off or 'on off'")
    if args.model == "llama":
        args.peers = ""  # the peers' model is the GPT
    args.skipped = {}
    if any(p.startswith("deepspeed") for p in args.peers.split()):
        sys.path.insert(0, str(PEERS))
        from peer_deepspeed import missing_reason

        if reason := missing_reason():
            args.skipped = {p: reason for p in args.peers.split() if p.startswith("deepspeed")}
    args.logdir = args.logdir or str(Path(args.out) / "logs")


def _runs(args: argparse.Namespace) -> list[tuple[str, list[str], Path]]:
    """``(name, command, working directory)`` of every launch: the peers, then ours by tp and
    stage, each followed by its compute-only floor unless ``--no-floor``."""
    n = str(args.world)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                n]
    runs: list[tuple[str, list[str], Path]] = []
    for p in args.peers.split():
        if p in args.skipped:
            continue
        if p.startswith("deepspeed_z"):
            runs.append((p, torchrun + [str(PEERS / "peer_deepspeed.py"), p[-1]], REPO))
        else:
            runs.append((p, torchrun + [str(PEERS / "peer_torch.py"), p], REPO))
    for s, tp in _our_configs(args):
        for fusion, offload in [(f, o) for f in args.fusion for o in args.offload]:
            name = (f"hybrid_z{s}" + (f"_tp{tp}" if tp > 1 else "")
                    + ("_nofusion" if fusion == "off" else "")
                    + ("_offload" if offload == "on" else ""))
            cmd = torchrun + [str(Path(__file__).resolve()), "--worker", str(s), str(tp)]
            cmd += ["--no-profile"] if args.no_profile else []
            cmd += ["--no-fusion"] if fusion == "off" else []
            cmd += ["--cpu-offload"] if offload == "on" else []
            runs.append((name, cmd, REPO))
            if not args.no_floor:
                runs.append((name + "_floor", cmd + ["--floor"], REPO))
    return runs


def _our_configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(stage, tp)`` of ours: ``--configs`` ('z1 z2_tp2') or every ``--tp`` x ``--stages``."""
    if not args.configs:
        return [(s, tp) for tp in args.tp for s in args.stages]
    out = []
    for item in args.configs.replace(",", " ").split():
        m = re.fullmatch(r"z([0-3])(?:_tp(\d+))?", item)
        if not m or args.world % int(m.group(2) or 1):
            sys.exit(f"--configs {item!r}: give z<stage>[_tp<t>], t dividing --world "
                     f"{args.world}, e.g. 'z1 z3 z2_tp2'")
        out.append((int(m.group(1)), int(m.group(2) or 1)))
    return out


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, floor=args.floor, profile=not args.no_profile,
                      fusion=not args.no_fusion, offload=args.cpu_offload)
    _check_args(ap, args)
    steps = args.steps or (6 if args.size == "medium" else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.size == "medium" else 3)
    env = dict(os.environ, PEER_SIZE=args.size, PEER_STEPS=str(steps), PEER_WARMUP=str(warmup),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", PEER_TP="2", HYBRID_GRAD_REDUCE=args.grad_reduce,
               HYBRID_NATIVE_COLLECTIVES=str(int(args.native_collectives)),
               HYBRID_REDUCE_BUCKET=str(args.reduce_bucket_size), HYBRID_MODEL=args.model,
               HYBRID_OVERLAP_PARAM_GATHER=str(int(args.overlap_param_gather)),
               HYBRID_KERNEL_FUSION=args.kernel_fusion)
    logdir = Path(args.logdir) / args.size
    logdir.mkdir(parents=True, exist_ok=True)
    runs = _runs(args)
    print(f"# size={args.size} world={args.world} steps={steps} warmup={warmup} logs={logdir}",
          flush=True)
    launches: dict[str, list] = {name: [] for name, _, _ in runs}
    for rep in range(args.repeats):
        for name, cmd, cwd in runs:
            res = launch(name, cmd, cwd, env, logdir)
            launches[name].append(res)
            if res is not None:
                print(f"# {name} [{rep + 1}/{args.repeats}]: {res['ms_step_median']} ms/step",
                      flush=True)
    results = {name: merge_repeats([r for r in rs if r]) for name, rs in launches.items()
               if any(rs)}
    with open(logdir / "results.jsonl", "w") as f:
        for r in results.values():
            f.write(json.dumps(r) + "\n")
    print_table(results)
    print("\n".join(_offload_lines(launches)))
    write_report(results, Path(args.out), args, steps, warmup, launches)
    from bench_zero_targets import targets_table

    print("\n".join(targets_table(launches, results, args.skipped)))
    if failed := [name for name, _, _ in runs if name not in results]:
        sys.exit(f"failed: {', '.join(failed)} (logs in {logdir})")


def _offload_lines(launches: dict) -> list[str]:
    """Per ``*_offload`` configuration: its ms/step over its device-optimizer twin's, median
    and spread over the rounds (each round's pair measured back to back), and the host AdamW's
    and the gradient copies' waits' share of its step (rank 0's profile)."""
    out = []
    for name, runs in launches.items():
        twin = launches.get(name.removesuffix("_offload"))
        if not name.endswith("_offload") or not twin:
            continue
        ratios = [a["ms_step_median"] / b["ms_step_median"]
                  for a, b in zip(runs, twin, strict=True) if a and b]
        prof = [r.get("profile_ms", {}) for r in runs if r]
        share = [(p.get("host_step", 0) + p.get("d2h_wait", 0)) / sum(p.values())
                 for p in prof if p]
        if ratios:
            out.append(f"# {name}: {statistics.median(ratios):.3f}x the ms/step of "
                       f"{name.removesuffix('_offload')} (rounds {min(ratios):.3f}-"
                       f"{max(ratios):.3f}); host AdamW + copy waits "
                       + (f"{statistics.median(share):.1%} of the step" if share else "n/a"))
    return out


def _int_list(ap, flag: str, text: str) -> list[int]:
    """``"1 2"`` or ``"1,2"`` -> ``[1, 2]``; an argparse error names the flag otherwise."""
    try:
        out = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        ap.error(f"{flag} {text!r}: give whole numbers separated by spaces or commas")
    if not out:
        ap.error(f"{flag}: give at least one value")
    return out


if __name__ == "__main__":
    main()
