"""ZeRO++ on CPU ranks acting as nodes: the ledger's intra-/inter-node bytes per rank per step of
ZeRO-3, hpZ (``--zero-hpz-partition-size``) and qwZ (``--zero-quantized-weights``), and the
training loss of a small Llama under qwZ against the exact run (arXiv 2306.10209 §3.1-3.2).

    python scripts/bench_zeropp.py                       # 4 ranks = 2 nodes of 2, tp 1, 100 its
    python scripts/bench_zeropp.py --world 8 --node 4 --tp 2 --iters 0   # bytes only, 8 ranks

Bytes: one optimizer step of ``--micro-batches`` micro-batches, bf16 parameters, fp32 gradients,
figures are rank 0's, in MiB. ``--param-persistence-threshold`` (default 1000) keeps the RMSNorm
weights whole, as the engine's default threshold does at scale: a quantization block that mixed
a norm's 1.0s with a matrix's 0.02s would quantize the matrix with the norm's scale.
Loss: ``--iters`` steps of a 4-block Llama (h 128, GQA 4/2 heads, SwiGLU, RoPE, RMSNorm, vocab
1024, s 64) on learnable synthetic tokens (``--data``: an 8-token motif per sequence with 10%
noise, or a Markov chain of 4 successors per token), bf16
ZeRO-3 with and without qwZ (and with hpZ on top, which must equal qwZ bit for bit); the loss is
the mean over the world of the last 10 iterations. Not a test: ``tests/test_zeropp.py`` asserts
the same properties on a tiny GPT.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=344, vocab_size=1024, max_position_embeddings=64,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True,
             hidden_dropout=0.0, attention_dropout=0.0)
RUNS = {"zero3": {}, "hpz": dict(hpz_partition_size=2), "qwz": dict(quantized_weights=True),
        "qwz+hpz": dict(quantized_weights=True, hpz_partition_size=2)}
SEQ, MICRO_BATCH = 64, 4


def _batch(step: int, rank: int, vocab: int, data: str = "motif"):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    if data == "markov":  # each token is followed by one of 4 fixed successors, uniformly
        succ = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))
        t = torch.empty(MICRO_BATCH, SEQ + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (MICRO_BATCH,), generator=g)
        pick = torch.randint(0, 4, (MICRO_BATCH, SEQ), generator=g)
        for i in range(SEQ):
            t[:, i + 1] = succ[t[:, i], pick[:, i]]
        return t[:, :-1], t[:, 1:]
    motif = torch.randint(0, 64, (MICRO_BATCH, 8), generator=g)
    t = motif.repeat(1, (SEQ + 8) // 8)[:, :SEQ + 1]
    t = torch.where(torch.rand(t.shape, generator=g) < 0.1,
                    torch.randint(0, vocab, t.shape, generator=g), t)
    return t[:, :-1], t[:, 1:]


def _engine(grid, kw: dict, threshold: int, lr: float):
    import torch

    from hybrid.config import GridConfig, PretrainConfig
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    zc = ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=threshold, **kw)
    return parallelize(GPT(GPTConfig(**LLAMA)), grid, PretrainConfig(
        grid=GridConfig(tensor_model_parallel_size=grid.tp_size), zero=zc,
        optimizer=OptimizerConfig(lr=lr)))


def run(rank: int, world: int, tp: int, node: int, runs: list[str], iters: int,
        micro: int, threshold: int, lr: float, data: str = "motif") -> dict:
    """Spawned world: per run, rank 0's ``node_bytes`` of the first step and the world-mean
    loss of every iteration (``iters`` steps; at least one)."""
    import torch
    import torch.distributed as dist

    from hybrid.parallel.grid import ProcessGrid
    from hybrid.zero.topology import NODE_SIZE_ENV

    os.environ[NODE_SIZE_ENV] = str(node)
    grid = ProcessGrid(tp=tp)
    out = {}
    for name in runs:
        e = _engine(grid, RUNS[name], threshold, lr)
        losses, nodes = [], None
        for it in range(max(1, iters)):
            total = torch.zeros(())
            for m in range(micro):
                x, y = _batch(it * micro + m, grid.dp_rank, LLAMA["vocab_size"], data)
                loss = e.model(x, y).float().mean() / micro
                e.backward(loss, is_last_micro_batch=m == micro - 1)
                total += loss.detach()
            info = e.step(lr)
            nodes = nodes or info.node_bytes
            dist.all_reduce(total)
            losses.append(total.item() / world)
        e.close()
        out[name] = dict(nodes=nodes, losses=losses)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4, help="CPU ranks (gloo)")
    ap.add_argument("--node", type=int, default=2, help="ranks per simulated node")
    ap.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    ap.add_argument("--iters", type=int, default=100, help="training iterations (0: bytes only)")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--param-persistence-threshold", type=int, default=1000,
                    help="ZeRO-3 keeps smaller local parameters whole (elements)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    ap.add_argument("--data", choices=("motif", "markov"), default="motif",
                    help="motif: an 8-token motif per sequence (an induction task, whose loss "
                    "drops steeply once learnt); markov: 4 fixed successors per token (ln 4 "
                    "floor, a smooth curve)")
    args = ap.parse_args()
    from hybrid.parallel.spawn import spawn_world

    res = spawn_world(args.world, run, args.tp, args.node, list(RUNS), args.iters,
                      args.micro_batches, args.param_persistence_threshold, args.lr, args.data,
                      timeout_s=300,
                      join_timeout_s=7200)[0]
    mib = 2.0**20
    print(f"world {args.world} = tp {args.tp} x dp {args.world // args.tp}, nodes of "
          f"{args.node} ranks; MiB per rank per step (rank 0), {args.micro_batches} micro-batch")
    print(f"{'run':>8} | {'inter gather':>12} | {'intra gather':>12} | {'inter reduce':>12} | "
          f"{'inter total':>11} | {'x zero3 gather':>14}")
    base = res["zero3"]["nodes"]["inter_node"].get("all_gather", 0.0)
    for name, r in res.items():
        inter, intra = r["nodes"]["inter_node"], r["nodes"]["intra_node"]
        g = inter.get("all_gather", 0.0)
        print(f"{name:>8} | {g / mib:12.4f} | {intra.get('all_gather', 0.0) / mib:12.4f} | "
              f"{inter.get('reduce_scatter', 0.0) / mib:12.4f} | "
              f"{sum(inter.values()) / mib:11.4f} | {g / base if base else 0:14.3f}")
    if args.iters:
        tail = {k: sum(r["losses"][-10:]) / len(r["losses"][-10:]) for k, r in res.items()}
        print(f"loss, mean of the last 10 of {args.iters} iterations: "
              + ", ".join(f"{k} {v:.5f}" for k, v in tail.items()))
        for i in sorted({0, 9, 49, args.iters - 1} & set(range(args.iters))):
            print(f"  iteration {i + 1}: " + ", ".join(f"{k} {r['losses'][i]:.5f}"
                                                      for k, r in res.items()))
        print(f"qwz vs zero3: {100 * (tail['qwz'] / tail['zero3'] - 1):+.3f}%; hpz == zero3 "
              f"bitwise: {res['hpz']['losses'] == res['zero3']['losses']}; qwz+hpz == qwz "
              f"bitwise: {res['qwz+hpz']['losses'] == res['qwz']['losses']}")


if __name__ == "__main__":
    main()
