"""Largest GPT that completes one training step with 4 ranks, per mode, under a memory cap.

Not a test. Modes: DDP (our ZeRO stage 0: every rank holds all model states, like torch DDP with
an fp32 master), ZeRO-1, ZeRO-2, ZeRO-3, and ZeRO-3 with tp=2 (dp=2) and full activation
checkpointing. All in bf16 with fp32 master and gradients (the engine's mixed precision: 18 bytes
per parameter unpartitioned). Width, heads, vocabulary and sequence are fixed; the layer count
grows by doubling, then bisection to within ``--resolution``.

The cap (``--budget-mib``, per process) is enforced with ``RLIMIT_AS`` so that an attempt that
does not fit fails fast with an allocation error instead of pushing the shared machine into
swap. Every attempt is a fresh ``hybrid.parallel.spawn.spawn_world`` of 4 ranks; in each rank:

1. baseline = the process's virtual size after ``import torch``, gloo init and one warm-up step
   of a 1-layer model of the same mode (threads, stacks and kernels any model needs; the
   ``import torch`` + gloo figure is reported too);
2. cap = baseline + budget, ONE cap for construction and the step: the model is created on
   ``meta`` and the ``ZeroEngine`` builds it unit by unit from ``seeded_weights`` (as
   ``hybrid.pretrain`` does: the construction peak is the model states plus one unit);
3. one optimizer step (forward, backward, AdamW) on random tokens under the same cap.

So the answer is "the largest model that can be built and trained for one step within
``budget`` above the process baseline"; the construction and step peaks are reported.
Activations are the same per layer in every mode and so bound each mode's ratio to DDP at
(18 + a) / (B + a) for B bytes of model states per parameter (DDP 18, ZeRO-1 9, ZeRO-2 6,
ZeRO-3 4.5 at dp 4) and a activation bytes per parameter; ``--checkpoint-activations``
(every mode) makes a small, so the ratios approach the model-state ones of ZeRO §5.

    python scripts/bench_scale.py                       # h=256, seq 64, 512 MiB per rank
    python scripts/bench_scale.py --modes "ddp zero3" --budget-mib 384 --out runs/bench
    python scripts/bench_scale.py --checkpoint-activations   # model-state capacity (ZeRO §5)
    # per-rank constants (staging, gathered units, gloo, Python objects per layer) are ~1/4 as
    # large a share of 2 GiB as of 512 MiB: ZeRO-2 / ZeRO-3 reach 2.9x / 3.8x DDP (about 75 min)
    python scripts/bench_scale.py --checkpoint-activations --resolution 0 --budget-mib 2048 \
        --modes "ddp zero2 zero3" --max-layers 1024

Env: MALLOC_MMAP_THRESHOLD_ / MALLOC_ARENA_MAX are set for the workers (every tensor its own
mapping, so freed memory leaves the address space at once). Writes ``scale.md``, ``scale.json``
and ``scale.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 2**20
MODES = {
    # name: (ZeRO stage, tp, activation checkpointing)
    "ddp": (0, 1, False),
    "zero1": (1, 1, False),
    "zero2": (2, 1, False),
    "zero3": (3, 1, False),
    "zero3_tp2_ckpt": (3, 2, True),
}
LABELS = {"ddp": "DDP (stage 0)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
          "zero3_tp2_ckpt": "ZeRO-3 + tp=2 + ckpt"}


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmSize, VmPeak, VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _cap(nbytes: int | None) -> None:
    soft = resource.RLIM_INFINITY if nbytes is None else int(nbytes)
    resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))


def attempt(rank: int, world: int, mode: str, model_kw: dict, seq: int, budget: int,
            construct: int, bucket: int, checkpoint_all: bool = False,
            persistence: int = 0) -> dict:
    """One training step of ``mode`` at ``model_kw`` (see the module docstring); raises
    RuntimeError('OOM ...') when an allocation fails under the cap."""
    import torch

    from hybrid.activation.config import ActivationConfig
    from hybrid.config import DataConfig, PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPTConfig

    stage, tp, ckpt = MODES[mode]
    ckpt = ckpt or checkpoint_all
    grid = ProcessGrid(tp=tp)

    def build(kw):
        cfg = GPTConfig(**kw, hidden_dropout=0.0, attention_dropout=0.0)
        return cfg, parallelize(meta_gpt(cfg), grid, PretrainConfig(
            zero=ZeroConfig(stage=stage, precision="bf16", reduce_bucket_size=bucket,
                            allgather_bucket_size=bucket, param_persistence_threshold=persistence),
            optimizer=OptimizerConfig(lr=1e-4),
            activation=ActivationConfig(checkpoint_activations=ckpt), data=DataConfig(seed=1234)))

    def one_step(cfg, engine, seed):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
        loss = engine.model(tokens[:, :-1], tokens[:, 1:]).mean()
        engine.backward(loss, is_last_micro_batch=True)
        engine.step(1e-4)
        return loss

    # Warm-up: one step of a 1-layer model of the same mode loads what any model needs
    # (autograd and gloo threads with their stacks, oneDNN kernels), so the baseline is the
    # process ready to train and the budget measures what the model itself adds.
    warm_cfg, warm = build(dict(model_kw, num_layers=1))
    one_step(warm_cfg, warm, 0)
    warm.close()
    del warm
    gc.collect()
    base = _status("VmSize")
    phase = "construction"
    try:
        _cap(base + (construct or budget))
        cfg, engine = build(model_kw)
        gc.collect()
        held, construct_peak = _status("VmSize") - base, _status("VmPeak") - base
        phase = "step"
        _cap(base + budget)
        if held > budget:
            raise MemoryError(f"held {held / MIB:.0f} MiB after construction > budget")
        loss = one_step(cfg, engine, grid.dp_rank)
        step_peak = _status("VmPeak") - base
        mem = engine.memory_bytes()
    except (MemoryError, RuntimeError) as err:
        _cap(None)
        text = str(err)
        # under the cap, oneDNN reports a failed allocation as "could not create a primitive"
        if isinstance(err, MemoryError) or any(s in text for s in ("allocate", "bad_alloc",
                                                                   "could not create a primitive")):
            raise RuntimeError(f"OOM in {phase}: {text[:200]}") from None
        raise
    _cap(None)
    return dict(base=base, held=held, construct_peak=construct_peak, step_peak=step_peak,
                rss_peak=_status("VmHWM"), states=sum(mem[k] for k in
                                                      ("params", "grads", "master", "optimizer")),
                buffers=mem["buffers"], gathered_peak=mem["gathered_peak"],
                local_params=engine.layout.numel, loss=loss.item())


def try_layers(mode: str, layers: int, args, log: list) -> dict | None:
    """Spawn 4 ranks for one attempt; the result of rank 0, or None when it did not fit."""
    from hybrid.flops import num_parameters
    from hybrid.parallel.spawn import spawn_world
    from hybrid.parallel.vocab import pad_vocab_size
    from models.config import GPTConfig

    kw = dict(num_layers=layers, hidden_size=args.hidden_size,
              num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
              max_position_embeddings=args.seq_length)
    params = num_parameters(GPTConfig(**{**kw, "vocab_size": pad_vocab_size(args.vocab_size)}))
    t0 = time.time()
    try:
        res = spawn_world(4, attempt, mode, kw, args.seq_length, args.budget_mib * MIB,
                          args.construct_mib * MIB, args.bucket, args.checkpoint_activations,
                          args.param_persistence_threshold, timeout_s=args.timeout_s)[0]
        res.update(ok=True)
    except RuntimeError as err:
        text = str(err)
        if not any(s in text for s in ("OOM", "allocate", "died without reporting",
                                        "Connection closed", "did not finish")):
            raise
        why = next((ln.strip() for ln in text.splitlines() if ln.startswith("RuntimeError: OOM")),
                   text.splitlines()[-1])
        res = dict(ok=False, why=why[:160])
    res.update(mode=mode, layers=layers, params=params, wall_s=round(time.time() - t0, 1))
    log.append(res)
    status = "fits" if res["ok"] else f"fails ({res['why'][:90]})"
    print(f"  {mode:<15} L={layers:<4} {params / 1e6:8.1f}M params: {status} "
          f"[{res['wall_s']:.0f} s]", flush=True)
    return res if res["ok"] else None


def search(mode: str, start: int, args, log: list) -> dict | None:
    """Largest fitting layer count: double from ``start`` (halve if it fails), then bisect until
    the gap is at most max(1, lo * resolution)."""
    lo_res, hi = None, None
    res = try_layers(mode, start, args, log)
    if res:
        lo_res = res
        while hi is None and lo_res["layers"] * 2 <= args.max_layers:
            nxt = try_layers(mode, lo_res["layers"] * 2, args, log)
            if nxt:
                lo_res = nxt
            else:
                hi = lo_res["layers"] * 2
    else:
        hi, n = start, start // 2
        while n >= 1:
            res = try_layers(mode, n, args, log)
            if res:
                lo_res = res
                break
            hi, n = n, n // 2
        if lo_res is None:
            return None
    while hi is not None and hi - lo_res["layers"] > max(1,
                                                         int(lo_res["layers"] * args.resolution)):
        mid = (lo_res["layers"] + hi) // 2
        res = try_layers(mode, mid, args, log)
        if res:
            lo_res = res
        else:
            hi = mid
    lo_res["first_failing_layers"] = hi
    return lo_res


def baseline_overhead() -> dict:
    """Virtual size and RSS of one rank after import torch + gloo init (4 ranks)."""
    from hybrid.parallel.spawn import spawn_world

    return max(spawn_world(4, _baseline, timeout_s=60), key=lambda d: d["vm"])


def _baseline(rank: int, world: int) -> dict:
    gc.collect()
    return dict(vm=_status("VmSize"), rss=_status("VmRSS"))


def report(results: dict, log: list, base: dict, args, wall: float) -> str:
    ddp = results.get("ddp")
    lines = [
        "| mode | largest L | params (M) | x DDP | first failing L | state MiB/rank | "
        "held MiB/rank | construction peak MiB | step peak MiB | bytes/param held | warm baseline "
        "MiB |",
        "|" + "---|" * 11,
    ]
    for mode, r in results.items():
        if r is None:
            lines.append(f"| {LABELS[mode]} | none fits | | | | | | | | | |")
            continue
        ratio = f"{r['params'] / ddp['params']:.2f}" if ddp else "-"
        lines.append(
            f"| {LABELS[mode]} | {r['layers']} | {r['params'] / 1e6:.1f} | {ratio} | "
            f"{r['first_failing_layers'] or '-'} | {r['states'] / MIB:.0f} | {r['held'] / MIB:.0f} "
            f"| {r['construct_peak'] / MIB:.0f} | {r['step_peak'] / MIB:.0f} | "
            f"{r['held'] / r['params']:.2f} | {r['base'] / MIB:.0f} |")
    head = (f"h={args.hidden_size}, heads={args.num_attention_heads}, vocab={args.vocab_size}, "
            f"seq={args.seq_length}, micro-batch 1, activation checkpointing "
            f"{'in every mode' if args.checkpoint_activations else 'only where the mode says'}, "
            f"bf16 (fp32 master and grads), 4 ranks, budget {args.budget_mib} MiB per rank above a "
            f"baseline of {base['vm'] / MIB:.0f} MiB virtual / {base['rss'] / MIB:.0f} MiB RSS "
            "(import torch + gloo), construction cap "
            f"{args.construct_mib or 'the same'}{' MiB' if args.construct_mib else ''}, buckets "
            f"{args.bucket:,} elements, ZeRO-3 persistence threshold "
            f"{args.param_persistence_threshold}; {len(log)} attempts, {wall / 60:.1f} min")
    return head + "\n\n" + "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m, r in results.items() if r]
    vals = [results[m]["params"] / 1e6 for m in modes]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar([LABELS[m] for m in modes], vals, color="tab:blue")
    ddp = results.get("ddp")
    for b, m in zip(bars, modes, strict=True):
        txt = f"{results[m]['layers']} L"
        if ddp:
            txt += f"\n{results[m]['params'] / ddp['params']:.2f}x"
        ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("parameters (M)")
    ax.set_title("Largest GPT completing one training step, 4 ranks, fixed per-rank budget")
    plt.setp(ax.get_xticklabels(), rotation=15, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=" ".join(MODES))
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--budget-mib", type=int, default=512, help="per-rank cap above the baseline")
    ap.add_argument("--construct-mib", type=int, default=0,
                    help="a separate (looser) cap while building the model and engine; 0 (the "
                         "default): the budget covers construction too")
    ap.add_argument("--bucket", type=int, default=1_000_000,
                    help="reduce / all-gather bucket elements (constant-size buffers, ZeRO §6.2)")
    ap.add_argument("--checkpoint-activations", action="store_true",
                    help="full activation checkpointing in every mode: activation memory per layer "
                         "is the same in every mode, so without it the ratio to DDP is bounded by "
                         "(18 + a) / (bytes per parameter of the mode + a), a = activation bytes "
                         "per parameter")
    ap.add_argument("--param-persistence-threshold", type=int, default=0,
                    help="ZeRO-3 keeps parameters under this many elements whole (DeepSpeed's "
                         "default 1e5 would keep every block's h x h projection at h=256: a third "
                         "of the model)")
    ap.add_argument("--timeout-s", type=float, default=60,
                    help="collective timeout of each attempt's world (raise it on a loaded "
                         "machine)")
    ap.add_argument("--start", type=int, default=8, help="first layer count tried")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--resolution", type=float, default=0.07,
                    help="stop bisecting when the gap is at most this fraction of the result")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_ARENA_MAX", "1")
    t0 = time.time()
    base = baseline_overhead()
    print(f"# baseline per rank: {base['vm'] / MIB:.0f} MiB virtual, {base['rss'] / MIB:.0f} MiB "
          f"RSS; budget {args.budget_mib} MiB above it", flush=True)
    results, log, start = {}, [], args.start
    for mode in args.modes.split():
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {list(MODES)}")
        results[mode] = search(mode, start, args, log)
        if results[mode]:
            start = results[mode]["layers"]  # modes are ordered by capacity
    wall = time.time() - t0
    text = report(results, log, base, args, wall)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(dict(results=results, attempts=log, baseline=base,
                                                    args=vars(args)), indent=1))
    plot(results, out / "scale.png")
    (out / "scale.md").write_text(
        "# Largest model per mode (4 ranks)\n\n"
        f"`python scripts/bench_scale.py {' '.join(sys.argv[1:])}`\n\n{text}\n\n"
        "params = whole-model parameters (padded vocabulary); held = the process's virtual size "
        "after construction minus the baseline; state = params + grads + master + Adam of the "
        "engine; construction / step peak = peak virtual size minus the baseline (the step peak "
        "includes the construction peak, which came first).\n\n![scale](scale.png)\n")
    print(f"wrote {out / 'scale.md'}, {out / 'scale.png'}")


if __name__ == "__main__":
    main()
