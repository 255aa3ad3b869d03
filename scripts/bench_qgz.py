"""ZeRO++ qgZ's two acceptance figures (issue 34): inter-node gradient bytes per step from the
byte ledger, qgZ against the 16-bit reduce-scatter, and the training loss of a small Llama with
qgZ against the exact run.

    python scripts/bench_qgz.py                  # 4 gloo ranks as 2 nodes x 2, 100 iterations
    python scripts/bench_qgz.py --iters 20 --stage 2

The ranks act as nodes of ``--node-size`` (``HYBRID_LOCAL_WORLD_SIZE``). Model: a Llama-style
GPT (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output; ``--layers`` x
``--hidden``), bf16, AdamW at ``--lr``; every step a fresh global batch of learnable sequences
(an 8-token motif from 64 ids repeated, 10% random ids), the same in every run. Runs: exact
(16-bit or fp32 gradient reduce-scatter), qgZ int4 (the default) and qgZ int8. Bytes are one
rank's per step, as the ledger counts them (``StepInfo.node_bytes``). Not a test;
``tests/test_qgz.py`` asserts the bounds on a smaller run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RUNS = {"exact bf16 grads": dict(grad_reduce_in_bf16=True),
        "exact fp32 grads": dict(),
        "qgZ int4": dict(quantized_gradients=True, quantized_gradients_bits=4),
        "qgZ int8": dict(quantized_gradients=True, quantized_gradients_bits=8)}


def _batch(step: int, rank: int, dp: int, per_rank: int, seq: int, vocab: int):
    """This rank's ``[per_rank, seq]`` inputs and labels of step ``step``'s global batch."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    b = per_rank * dp
    pattern = torch.randint(0, 64, (b, 8), generator=g)
    t = pattern.repeat(1, (seq + 8) // 8)[:, :seq + 1]
    noise = torch.randint(0, vocab, t.shape, generator=g)
    t = torch.where(torch.rand(t.shape, generator=g) < 0.1, noise, t)[rank::dp]
    return t[:, :-1], t[:, 1:]


def run(rank: int, world: int, args) -> dict:
    """Spawned world (tp 1): per run, the losses and the ledger of the last step (rank 0)."""
    import torch

    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPT, GPTConfig

    os.environ["HYBRID_LOCAL_WORLD_SIZE"] = str(args.node_size)
    grid = ProcessGrid(tp=1)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                    num_query_groups=2, ffn_hidden_size=args.hidden * 8 // 3 // 8 * 8,
                    vocab_size=1024, max_position_embeddings=args.seq,
                    position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    hidden_dropout=0.0, attention_dropout=0.0)
    out = {}
    for name, kw in RUNS.items():
        torch.manual_seed(0)
        zc = ZeroConfig(stage=args.stage, precision="bf16", param_persistence_threshold=0, **kw)
        e = parallelize(GPT(cfg), grid, PretrainConfig(
            zero=zc, optimizer=OptimizerConfig(lr=args.lr, weight_decay=0.1, clip_grad=1.0)))
        losses = []
        for step in range(args.iters):
            x, y = _batch(step, grid.dp_rank, grid.dp_size, args.batch, args.seq, 1024)
            loss = e.model(x, y).mean()
            e.backward(loss, is_last_micro_batch=True)
            info = e.step(args.lr)
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean, group=grid.dp_group)
            losses.append(mean.item() / grid.dp_size)
        out[name] = dict(losses=losses, nodes=info.node_bytes, total=info.comm_bytes,
                         psi=e.layout.numel)
        e.close()
    return out if rank == 0 else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=4, help="data-parallel ranks (gloo, CPU)")
    ap.add_argument("--node-size", type=int, default=2, help="ranks per simulated node")
    ap.add_argument("--stage", type=int, default=3, choices=(2, 3), help="ZeRO stage")
    ap.add_argument("--iters", type=int, default=100, help="training iterations per run")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--seq", type=int, default=64, help="sequence length")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    args = ap.parse_args()
    from hybrid.parallel.spawn import spawn_world

    res = spawn_world(args.dp, run, args, timeout_s=300)[0]
    base = res["exact fp32 grads"]  # the default engine: the losses' reference
    rs16 = res["exact bf16 grads"]["total"]["reduce_scatter"]  # the 16-bit reduce-scatter
    print(f"dp {args.dp} as {args.dp // args.node_size} nodes x {args.node_size}, ZeRO-"
          f"{args.stage}, Psi {base['psi']:,}; bytes per rank per step (ledger)")
    print(f"{'run':<18} {'RS inter':>12} {'RS intra':>12} {'x 16-bit RS':>12} "
          f"{'loss 1':>8} {'loss N':>8} {'max |rel| vs exact':>19} {'last-10 mean rel':>17}")
    for name, r in res.items():
        inter = r["nodes"]["inter_node"].get("reduce_scatter", 0.0)
        intra = r["nodes"]["intra_node"].get("reduce_scatter", 0.0)
        rel = [abs(a - b) / b for a, b in zip(r["losses"], base["losses"], strict=True)]
        tail = (sum(r["losses"][-10:]) - sum(base["losses"][-10:])) / sum(base["losses"][-10:])
        print(f"{name:<18} {inter:12,.0f} {intra:12,.0f} {inter / rs16:12.3f} "
              f"{r['losses'][0]:8.4f} {r['losses'][-1]:8.4f} {max(rel):19.2e} {tail:17.2e}")


if __name__ == "__main__":
    main()
