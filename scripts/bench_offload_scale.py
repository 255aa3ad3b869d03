"""Largest GPT whose rank fits a device-memory cap, with and without ``--optimizer-cpu-offload``.

Not a test. On a CPU-only machine device memory can only be measured by the dry run on fake CUDA
devices (``hybrid.dryrun``: the rank is built and stepped under ``FakeTensorMode``, every
storage counted; with offload the host master, moments and gradient copy are host storages,
left out of the device total). Each attempt is one dry run of rank 0 (``python -m
hybrid.dryrun.verify`` in a fresh interpreter with the fake CUDA library loaded); the layer
count at fixed width grows by doubling, then bisection, until the measured device step peak no
longer fits ``--cap-gib``. Modes (each with its ``_offload`` twin, measured in the same run):

- ``gpu1``: one GPU (dp 1, ZeRO-1), bf16 with fp32 gradients: 18 bytes per parameter on the
  device without offload, 6 (bf16 parameters + fp32 gradients) with it;
- ``gpu1_bf16g``: the same with ``--grad-reduce-in-bf16`` (16 and 4 bytes);
- ``dp4_z2``: rank 0 of 4, ZeRO-2: 2 + (4 + 12) / 4 bytes without, 2 + 4 / 4 with offload.

Full activation checkpointing everywhere (model states dominate, as in the ZeRO-Offload paper's
capacity test, arXiv 2101.06840 §6.2).

    python scripts/bench_offload_scale.py --cap-gib 4 --modes "gpu1 gpu1_bf16g dp4_z2"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = {"gpu1": (1, 1, []), "gpu1_bf16g": (1, 1, ["--grad-reduce-in-bf16"]),
         "dp4_z2": (4, 2, [])}
"""mode -> (world size, ZeRO stage, extra flags)."""


def attempt(layers: int, world: int, stage: int, extra: list[str], args) -> tuple[bool, float]:
    """Dry-run rank 0 of a ``layers``-layer GPT: ``(fits, device step peak in GiB)``."""
    from hybrid.dryrun.fake_cuda import preloaded_command

    argv = ["--mock-data", "--num-layers", str(layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.hidden // 64), "--seq-length", str(args.seq),
            "--vocab-size", "50257", "--micro-batch-size", "1", "--global-batch-size",
            str(world), "--train-iters", "1", "--bf16", "--zero-stage", str(stage),
            "--checkpoint-activations", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--gpu-memory-gib", str(args.cap_gib), "--reserved-gib", "0",
            "--dry-run-world-size", str(world), "--dry-run-device", "cuda", *extra]
    cmd, env = preloaded_command("from hybrid.dryrun.verify import main\n", argv)
    out = subprocess.run(cmd, env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, cwd=REPO, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            return r["fits"], r["step_peak_gib"]
    raise RuntimeError(f"dry run of {layers} layers failed: {out.stderr[-1500:]}")


def largest(world: int, stage: int, extra: list[str], args) -> tuple[int, float, int]:
    """``(largest fitting layer count, its device peak GiB, attempts)``: doubling from
    ``--start-layers``, then bisection to ``--resolution`` layers."""
    lo, hi, peak, n = 0, None, 0.0, 0
    layers = args.start_layers
    while hi is None or hi - lo > args.resolution:
        fits, gib = attempt(layers, world, stage, extra, args)
        n += 1
        print(f"#   {layers} layers: {gib:.3f} GiB {'fits' if fits else 'does not fit'}",
              flush=True)
        if fits:
            lo, peak = layers, gib
        else:
            hi = layers
        layers = layers * 2 if hi is None else (lo + hi) // 2
        if lo == 0 and hi is not None and hi <= 1:
            break
    return lo, peak, n


def params(layers: int, h: int) -> float:
    """Parameters of the GPT (12 h^2 per layer + the 50,257 x h embedding), in billions."""
    return (12 * h * h * layers + 50257 * h) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-gib", type=float, default=4.0, help="device memory per rank, GiB")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--modes", default="gpu1 gpu1_bf16g dp4_z2")
    ap.add_argument("--start-layers", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=1)
    args = ap.parse_args()
    rows = []
    for mode in args.modes.split():
        world, stage, extra = MODES[mode]
        found = {}
        for offload in (False, True):
            name = mode + ("_offload" if offload else "")
            t = time.time()
            print(f"# {name}", flush=True)
            flags = extra + (["--optimizer-cpu-offload"] if offload else [])
            found[offload] = largest(world, stage, flags, args)
            layers, gib, n = found[offload]
            rows.append((name, layers, params(layers, args.hidden), gib, n, time.time() - t))
        ratio = params(found[True][0], args.hidden) / max(params(found[False][0], args.hidden),
                                                          1e-12)
        rows.append((f"{mode}: offload / device", None, ratio, None, None, None))
    print(f"\nlargest GPT (h={args.hidden}, seq {args.seq}, full recompute, bf16) per rank under "
          f"{args.cap_gib} GiB of device memory (dry run on fake CUDA)")
    print(f"{'mode':<28}{'layers':>8}{'params (B)':>12}{'peak GiB':>10}{'tries':>7}")
    for name, layers, p, gib, n, _ in rows:
        if layers is None:
            print(f"{name:<28}{'':>8}{p:>11.2f}x")
        else:
            print(f"{name:<28}{layers:>8}{p:>12.3f}{gib:>10.3f}{n:>7}")


if __name__ == "__main__":
    main()
