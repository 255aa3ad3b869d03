"""GPU benchmark: tokens/s, TFLOP/s and MFU of a GPT-2 1.5B-class model on one
GPU in bf16, our ZeRO stage 0 vs a plain torch loop, and peak memory with and without P_a and the
checkpoint arena. One command, a few minutes on one H200:

    python scripts/bench_gpu.py                      # gpt2-1.5b, seq 1024, micro-batch 8
    python scripts/bench_gpu.py --model zero-1.5b --micro-batch-size 4 --steps 8
    python scripts/bench_gpu.py --smoke              # tiny model on CPU (the test suite runs it)

Without a CUDA device and without ``--smoke`` it exits with status 2 and says so.

What runs, each in its own process (so each peak is its own):

1. **ours**: a 1-rank world (NCCL), ``GPT`` built by ``hybrid.parallelize.parallelize``
   (tp = 1), ``ZeroEngine(stage=0, precision="bf16")``: bf16 parameters and compute, fp32
   gradient accumulation, fp32 master and AdamW (torch.optim.AdamW on the fp32 master
   fragments), clipping at 1.0: 18 bytes of state per parameter.
2. **torch**: the same ``GPT`` (vocabulary padded as ours, to a multiple of 128), fp32
   parameters, forward/backward under ``torch.autocast("cuda", torch.bfloat16)``,
   ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_(1.0)``: 16 bytes of state per
   parameter, bf16 GEMMs. This is the usual plain-PyTorch mixed-precision loop (autocast, not
   bf16 parameters with a separate master).
3. **activations**: ``scripts/gpu_activation_memory.py``'s measurement (``--pa-tp`` ranks sharing
   the GPU, since P_a needs tp > 1; default the smallest tp > 1 that divides the heads: 5 for
   gpt2-1.5b's 25): peak allocated with no checkpointing, checkpointing, + arena, P_a,
   P_a + arena, P_a + cpu, on the same model dimensions (forward/backward only, no optimizer).

Timing: ``--warmup`` steps, then the median of ``--steps`` timed optimizer steps (forward,
backward, optimizer, ``torch.cuda.synchronize``). TFLOP/s = model FLOPs per step
(``hybrid.flops.flops_per_iteration``, 2205.05198 Eq. 7, no recompute) / step time; MFU = that
/ ``hybrid.flops.device_peak_tflops()``. Writes ``gpu.md``, ``gpu.json``, ``gpu.png`` under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MIB = 2**20


def _config(a: dict):
    from models.gpt import GPTConfig
    from models.presets import get_preset

    if a["smoke"]:
        return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500,
                         max_position_embeddings=a["seq_length"], hidden_dropout=0.0,
                         attention_dropout=0.0)
    return get_preset(a["model"], max_position_embeddings=a["seq_length"], hidden_dropout=0.0,
                      attention_dropout=0.0)


def _timed(step, a: dict, device) -> dict:
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(a["warmup"] + a["steps"]):
        t0 = time.perf_counter()
        loss = step(i)
        if cuda:
            torch.cuda.synchronize()
        if i >= a["warmup"]:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    return dict(step_s=statistics.median(times), losses=losses,
                peak_allocated=torch.cuda.max_memory_allocated(device) if cuda else 0,
                peak_reserved=torch.cuda.max_memory_reserved(device) if cuda else 0)


def _batch(cfg, a: dict, i: int, device):
    import torch

    g = torch.Generator().manual_seed(i)
    t = torch.randint(0, cfg.vocab_size, (a["micro_batch_size"], a["seq_length"] + 1), generator=g)
    t = t.to(device)
    return t[:, :-1], t[:, 1:]


def run_ours(rank: int, world: int, a: dict) -> dict:
    """ZeRO stage 0, bf16, in this 1-rank world."""
    import torch

    from hybrid.config import DataConfig, PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    grid = ProcessGrid(tp=1, device=device)
    cfg = _config(a)
    engine = parallelize(meta_gpt(cfg), grid, PretrainConfig(
        zero=ZeroConfig(stage=0, precision="bf16"),
        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0), data=DataConfig(seed=1234)))
    state = engine.memory_bytes()

    def step(i):
        x, y = _batch(cfg, a, i, device)
        loss = engine.model(x, y).mean()
        engine.backward(loss, is_last_micro_batch=True)
        engine.step(1e-4)
        return loss.item()

    out = _timed(step, a, device)
    out["state_bytes"] = sum(state[k] for k in ("params", "grads", "master", "optimizer"))
    out["params"] = sum(p.numel() for p in engine.model.parameters())
    return out


def run_torch(rank: int, world: int, a: dict) -> dict:
    """The plain loop: fp32 params, bf16 autocast, fused AdamW (fused only on CUDA)."""
    import dataclasses

    import torch

    from hybrid.parallel.vocab import pad_vocab_size
    from models.gpt import GPT

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cfg = _config(a)
    torch.manual_seed(1234)
    with torch.device(device):  # the padded vocabulary of ours (tp = 1): the same GEMMs
        model = GPT(dataclasses.replace(cfg, vocab_size=pad_vocab_size(cfg.vocab_size)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(i):
        x, y = _batch(cfg, a, i, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = _timed(step, a, device)
    n = sum(p.numel() for p in model.parameters())
    out["state_bytes"] = n * (4 + 4 + 8)
    out["params"] = n
    return out


def pa_tp_for(heads: int) -> int:
    """The smallest tp > 1 that divides ``heads`` (P_a needs tp > 1; 1 when ``heads`` is 1)."""
    return next((t for t in range(2, heads + 1) if heads % t == 0), 1)


def throughput(res: dict, cfg, a: dict, peak: float | None) -> dict:
    from hybrid.flops import flops_per_iteration

    flops = flops_per_iteration(cfg, a["micro_batch_size"], a["seq_length"], "none")
    tflops = flops / res["step_s"] / 1e12
    return dict(tokens_per_s=a["micro_batch_size"] * a["seq_length"] / res["step_s"],
                tflops=tflops, mfu=(tflops / peak) if peak else None)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-1.5b", help="models.presets name")
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pa-micro-batch-size", type=int, default=4,
                    help="micro-batch of the P_a / arena measurement")
    ap.add_argument("--pa-tp", type=int, default=None,
                    help="tp of the P_a / arena measurement (default: the smallest tp > 1 that "
                         "divides the heads)")
    ap.add_argument("--skip-activations", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU allowed (for tests)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_gpu: needs a CUDA device (use --smoke for a tiny CPU run)", file=sys.stderr)
        return 2
    if args.smoke:
        args.seq_length, args.micro_batch_size = 32, 2
        args.steps, args.warmup, args.pa_micro_batch_size = 2, 1, 2
    a = dict(vars(args))

    from hybrid.flops import device_peak_tflops, num_parameters
    from hybrid.parallel.spawn import spawn_world

    cfg = _config(a)
    heads = cfg.num_attention_heads
    pa_tp = args.pa_tp or pa_tp_for(heads)
    if pa_tp < 2 or heads % pa_tp:
        print(f"bench_gpu: --pa-tp {pa_tp} must be > 1 and divide the {heads} attention heads",
              file=sys.stderr)
        return 2
    peak = device_peak_tflops()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    results = {}
    for name, fn in (("ours: ZeRO stage 0 bf16", run_ours),
                     ("torch: autocast bf16 + fused AdamW", run_torch)):
        res = spawn_world(1, fn, a, timeout_s=600,
                          backend="nccl" if torch.cuda.is_available() else "gloo")[0]
        res.update(throughput(res, cfg, a, peak))
        results[name] = res
        print(f"# {name}: {res['step_s'] * 1e3:.1f} ms/step", flush=True)
    acts = None
    if not args.skip_activations:
        import gpu_activation_memory as G

        acts = G.run(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                     heads=cfg.num_attention_heads, seq_length=args.seq_length,
                     micro_batch_size=args.pa_micro_batch_size, micro_batches=2,
                     vocab_size=cfg.vocab_size, tp=pa_tp,
                     device=None if torch.cuda.is_available() else "cpu")
    wall = time.time() - t0

    lines = [f"{cfg.num_layers} layers, h={cfg.hidden_size}, heads={cfg.num_attention_heads}, "
             f"{num_parameters(cfg) / 1e9:.3f}B params, seq {args.seq_length}, micro-batch "
             f"{args.micro_batch_size}, {args.steps} timed steps after {args.warmup}; device "
             f"{device}, peak {peak} TFLOP/s (bf16 dense); {wall:.0f} s",
             "",
             "| run | ms/step | tokens/s | TFLOP/s | MFU | peak alloc GiB | state GiB | loss first "
             "-> last |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | {mfu} | {r['peak_allocated'] / 2**30:.2f} | "
                     f"{r['state_bytes'] / 2**30:.2f} | {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f} |")
    ours, plain = results.values()
    lines.append(f"\nours / torch tokens/s: {ours['tokens_per_s'] / plain['tokens_per_s']:.2f}")
    if acts is not None:
        import gpu_activation_memory as G

        lines += ["", f"Activation memory (tp = {pa_tp} on one device, micro-batch "
                  f"{args.pa_micro_batch_size}, 2 micro-batches, no optimizer):", "```",
                  G.report(acts), "```"]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu_smoke" if args.smoke else "gpu"
    (out / f"{tag}.json").write_text(json.dumps(dict(results=results, activations=acts, args=a),
                                                indent=1, default=str))
    _plot(results, acts, out / f"{tag}.png")
    (out / f"{tag}.md").write_text(f"# GPU benchmark\n\n`python scripts/bench_gpu.py "
                                   f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
                                   f"{text}\n\n![gpu]({tag}.png)\n")
    return 0


def _plot(results: dict, acts: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if acts else 1, figsize=(11 if acts else 6, 4), squeeze=False)
    ax = axes[0][0]
    names = list(results)
    ax.bar(["ours (ZeRO-0)", "torch loop"], [results[n]["tokens_per_s"] for n in names])
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput, one GPU, bf16")
    if acts:
        ax = axes[0][1]
        opts = [k for k in acts if not k.startswith("_")]
        ax.bar(opts, [acts[k]["peak_allocated"] / MIB for k in opts])
        ax.set_ylabel("peak allocated MiB")
        ax.set_title("activation options (tp=2)")
        plt.setp(ax.get_xticklabels(), rotation=30, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
