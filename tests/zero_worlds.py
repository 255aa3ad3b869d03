"""World functions and the single-process reference for the ZeRO engine tests (importable).

Model: a 2-block GPT whose MLP width 126 gives a 63-element ``fc1.bias`` shard at tp=2 (and
units whose sizes are no multiple of dp), so partitions need padding. One optimizer step uses a
global batch of 8 sequences split over dp ranks x 2 micro-batches; the reference runs the plain
GPT on all 8 at once with torch.optim.AdamW (same two groups) and clip_grad_norm_.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hybrid.grid import ProcessGrid
from hybrid.tp_plan import parallelize_gpt
from hybrid.zero import OptimizerConfig, ZeroConfig, ZeroEngine
from hybrid.zero_layout import no_weight_decay
from models.gpt import GPT, GPTConfig

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=126,
           vocab_size=1001, max_position_embeddings=32, hidden_dropout=0.0,
           attention_dropout=0.0)
GLOBAL_BATCH, SEQ, MICRO, STEPS, SEED = 8, 16, 2, 5, 1234
# adam_eps 1e-6: the attention key bias has an exactly-zero true gradient (softmax is invariant
# to it), so its computed gradient is rounding noise (~1e-10) that Adam would blow up to
# lr * noise / (sqrt(v) + eps); a larger eps keeps that below the 1e-5 parity tolerance.
OPT = dict(lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, clip_grad=1.0)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def micro_batch(step: int, dp_rank: int, dp: int, m: int, micro: int = MICRO):
    """Sequences of data-parallel rank ``dp_rank``'s micro-batch ``m`` (a slice of the global batch)."""
    x, y = global_batch(step)
    per = GLOBAL_BATCH // (dp * micro)
    lo = (m * dp + dp_rank) * per
    return x[lo:lo + per], y[lo:lo + per]


def reference(steps: int = STEPS, clip: float = OPT["clip_grad"]):
    """Single-process GPT + AdamW: per-step losses, pre-clip norms, params after step 1 and at end."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
    nodecay = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                             {"params": nodecay, "weight_decay": 0.0}], lr=OPT["lr"],
                            betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"])
    losses, norms, first = [], [], None
    for step in range(steps):
        x, y = global_batch(step)
        loss = model(x, y).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e30).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0:
            first = {k: v.clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, first=first,
                final={k: v.clone() for k, v in model.state_dict().items()})


class CheckpointBlock(nn.Module):
    """Activation checkpointing of a whole block, as a wrapper (recompute in backward)."""

    def __init__(self, block, reentrant: bool):
        super().__init__()
        self._checkpoint_wrapped_module = block
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self._checkpoint_wrapped_module, x, use_reentrant=self.reentrant)


def build(grid: ProcessGrid, zc: ZeroConfig, opt: dict | None = None, ckpt: str | None = None):
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    parallelize_gpt(model, grid.tp_group)
    if ckpt is not None:
        for i in range(len(model.layers)):
            model.layers[i] = CheckpointBlock(model.layers[i], reentrant=ckpt == "reentrant")
    return ZeroEngine(model, grid, zc, OptimizerConfig(**(opt or OPT)))


def train(engine: ZeroEngine, grid: ProcessGrid, steps: int = STEPS, inject=None,
          micro: int = MICRO) -> dict:
    """Run ``steps`` optimizer steps; returns losses, infos, and full params after step 1 / end.

    ``inject(step, m)`` may return a tensor hook to register for that micro-batch's backward.
    """
    losses, infos, first = [], [], None
    dp = grid.dp_size
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            x, y = micro_batch(step, grid.dp_rank, dp, m, micro)
            loss = engine.model(x, y).mean() / micro
            handle = inject(step, m) if inject else None
            engine.backward(loss, is_last_micro_batch=(m == micro - 1))
            if handle is not None:
                handle.remove()
            total += loss.item()
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t, group=grid.dp_group)
        losses.append(t.item() / dp)
        info = engine.step(OPT["lr"])
        infos.append(dict(skipped=info.skipped, grad_norm=info.grad_norm,
                          loss_scale=info.loss_scale, comm=info.comm_bytes))
        if step == 0:
            first = engine.model_state_dict_full()
    return dict(losses=losses, infos=infos, first=first, final=engine.model_state_dict_full())
