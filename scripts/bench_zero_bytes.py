"""Bytes the ZeRO engine moves through memory outside its collectives, per micro-batch, per stage,
gradient-accumulation fusion off (the path before issue 33) and on, counted from the engine's
own ops (:class:`hybrid.zero.bytes_meter.EngineBytes`), not estimated.

    python scripts/bench_zero_bytes.py            # dp 2, fp32 / bf16 / bf16 + bf16 gradients
    python scripts/bench_zero_bytes.py --dp 4

Two micro-batches per step: the first only accumulates at stages 0/1, the last reduces (stages
2/3 reduce in both). Figures are bytes per local parameter element (Psi = the layout's real
element count), so they do not depend on the model's size; the model is a 2-layer GPT (h 256).
Not a test; ``tests/test_zero_bytes.py`` asserts the targets on the same measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PRECISIONS = {"fp32": dict(precision="fp32"), "bf16": dict(precision="bf16"),
              "bf16+bf16grad": dict(precision="bf16", grad_reduce_in_bf16=True)}


def _engine(grid, stage: int, fusion: bool, prec: dict):
    import torch

    from hybrid.config import PretrainConfig
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                          max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0))
    zc = ZeroConfig(stage=stage, gradient_accumulation_fusion=fusion, reduce_bucket_size=200_000,
                    param_persistence_threshold=0, **prec)
    return parallelize(model, grid, PretrainConfig(zero=zc, optimizer=OptimizerConfig()))


def measure(rank: int, world: int, stages=(0, 1, 2, 3), precisions=tuple(PRECISIONS)) -> dict:
    """Spawned world (tp 1, dp = world): ``{(stage, precision, fusion): {"micro_batches":
    [bytes per element of each micro-batch's backward], "ops": [{op: bytes}, ...], "psi": n}}``
    for rank 0's engine."""
    import torch

    from hybrid.parallel.grid import ProcessGrid
    from hybrid.zero.bytes_meter import EngineBytes, collectives_uncounted, engine_buffers

    grid = ProcessGrid(tp=1)
    out = {}
    for stage in stages:
        for pname in precisions:
            for fusion in (False, True):
                e = _engine(grid, stage, fusion, PRECISIONS[pname])
                meter = EngineBytes(engine_buffers(e))
                per_mb, ops = [], []
                g = torch.Generator().manual_seed(grid.dp_rank)
                for m in range(2):
                    x = torch.randint(0, 1024, (2, 64), generator=g)
                    loss = e.model(x, x).mean() / 2
                    meter.reset()
                    with meter, collectives_uncounted(meter):
                        e.backward(loss, is_last_micro_batch=m == 1)
                    per_mb.append(meter.total / e.layout.numel)
                    ops.append({k: round(v / e.layout.numel, 2) for k, v in meter.by_op.items()})
                e.step(1e-4)
                e.close()
                out[(stage, pname, fusion)] = dict(micro_batches=per_mb, ops=ops,
                                                   psi=e.layout.numel)
    return out if rank == 0 else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks (gloo, CPU)")
    args = ap.parse_args()
    from hybrid.parallel.spawn import spawn_world

    res = spawn_world(args.dp, measure, timeout_s=120)[0]
    print(f"bytes per parameter element per micro-batch, outside collectives (dp {args.dp}; "
          "mb 1 accumulates, mb 2 is the last)")
    print(f"{'stage':>5} {'precision':<14} {'fusion':<6} {'mb 1':>7} {'mb 2':>7}  ops of mb 2")
    for (stage, pname, fusion), r in res.items():
        a, b = r["micro_batches"]
        ops = ", ".join(f"{k} {v:g}" for k, v in sorted(r["ops"][1].items()))
        print(f"{stage:>5} {pname:<14} {'on' if fusion else 'off':<6} {a:7.2f} {b:7.2f}  {ops}")


if __name__ == "__main__":
    main()
