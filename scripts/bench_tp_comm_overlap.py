"""CPU timing of ``--tp-comm-overlap`` against the plain sequence-parallel run, same world.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/bench_tp_comm_overlap.py [--tp 2] [--rounds 6]
        [--layers 4] [--hidden 512] [--seq 512] [--micro-batch 2] [--blocks]

One spawned gloo world of ``tp`` ranks builds the same GPT twice (sequence parallelism, dropout
0, fp32), once plain and once with the collective-matmul rings
(:mod:`hybrid.parallel.linear.collective_matmul`), and times forward + backward of one micro-batch
(``--blocks``: the blocks' forward only) in interleaved rounds (plain, overlapped, plain, ...;
one warm-up round first), so a load change on the machine hits both alike. Prints each
round's seconds and the median of the per-round ratios overlapped / plain on rank 0.

On CPU with gloo the transfers are memory copies through a socket, run by gloo's threads on the
same cores as the GEMMs: little or nothing can really run beside the compute, and each ring
adds ``2 (t - 1)`` point-to-point calls per collective. The figure says what the rings cost
here, not what NVLink gains (``hybrid.planner.step_time.ring_exposed`` models that).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.spawn import spawn_world
from hybrid.parallel.tp_plan import parallelize_gpt
from models.gpt import GPT, GPTConfig


def _models(grid: ProcessGrid, args) -> dict:
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden,
                    num_attention_heads=args.hidden // 64, vocab_size=8192,
                    max_position_embeddings=args.seq, hidden_dropout=0.0,
                    attention_dropout=0.0)
    out = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        torch.manual_seed(1234)
        out[name] = parallelize_gpt(GPT(cfg), grid.tp_group, sequence_parallel=True,
                                    tp_comm_overlap=overlap)
    return out


def _once(model, x, y, blocks_only: bool, tp: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    if blocks_only:
        h = torch.randn(x.shape[0], x.shape[1] // tp, model.config.hidden_size,
                        generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for block in model.layers:
                h = block(h)
    else:
        model(x, y).mean().backward()
    dist.barrier()
    return time.perf_counter() - t0


def bench_world(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    grid = ProcessGrid(tp=world)
    models = _models(grid, args)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 8192, (args.micro_batch, args.seq + 1), generator=g)
    x, y = x[:, :-1], x[:, 1:]
    rounds = []
    for r in range(args.rounds + 1):
        times = {n: _once(m, x, y, args.blocks, world) for n, m in models.items()}
        if r:  # round 0 warms up
            rounds.append(times)
    return {"rounds": rounds,
            "ratio": statistics.median(t["overlap"] / t["plain"] for t in rounds)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--blocks", action="store_true", help="time the blocks' forward only")
    args = p.parse_args(argv)
    res = spawn_world(args.tp, bench_world, args, timeout_s=600)[0]
    what = "blocks' forward" if args.blocks else "forward + backward"
    print(f"tp {args.tp}, {args.layers} layers, h {args.hidden}, s {args.seq}, "
          f"b {args.micro_batch}, {what}, seconds per round (plain / overlap):")
    for t in res["rounds"]:
        print(f"  {t['plain']:.3f} / {t['overlap']:.3f}  ratio {t['overlap'] / t['plain']:.3f}")
    print(f"median ratio overlap / plain: {res['ratio']:.3f}")


if __name__ == "__main__":
    main()
