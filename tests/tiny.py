"""The tiny GPT every multi-process test world uses: one config, one batch maker, one
single-process reference and one parallel build on :func:`hybrid.parallelize.parallelize`.

``TINY``: 2 blocks of width 64 with 4 heads, MLP width 126 (a 63-element ``fc1.bias`` shard at
tp = 2, and units whose sizes are no multiple of dp, so ZeRO partitions need padding), vocabulary
1001 (padded by TP), 32 positions, no dropout. A world that needs another shape says so with
:func:`tiny_config` overrides (e.g. the TP world's tp = 4 needs the default MLP width 4h).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from models.gpt import GPT, GPTConfig

if TYPE_CHECKING:
    from hybrid.activation.config import ActivationConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from hybrid.zero.engine import ZeroEngine

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=126,
            vocab_size=1001, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
SEED = 1234
"""Seed of the weights: ``torch.manual_seed(SEED)`` then ``GPT(config)`` on every rank and in the
reference."""


def tiny_config(**overrides) -> dict:
    """``GPTConfig`` keyword arguments: :data:`TINY` with ``overrides``."""
    return dict(TINY, **overrides)


def make_batch(seed: int, b: int = 2, s: int = 16, vocab: int = 1001, motif: bool = False):
    """``(x, y)``: ``[b, s]`` int64 inputs and next-token labels, reproducible from ``seed``.

    ``motif=False``: uniform random ids. ``motif=True``: learnable tokens (losses fall smoothly,
    so runs in two precisions stay comparable): each sequence repeats an 8-token motif drawn from
    64 ids, with 10% of the tokens replaced by random ids.
    """
    g = torch.Generator().manual_seed(seed)
    if motif:
        pattern = torch.randint(0, 64, (b, 8), generator=g)
        t = pattern.repeat(1, (s + 1 + 7) // 8)[:, :s + 1]
        noise = torch.randint(0, vocab, t.shape, generator=g)
        t = torch.where(torch.rand(t.shape, generator=g) < 0.1, noise, t)
    else:
        t = torch.randint(0, vocab, (b, s + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def reference(config_kw: dict, batches, optimizer: dict | None = None, seed: int = SEED) -> dict:
    """The single-process GPT on ``batches`` (one batch per step), the ground truth of every parity
    test.

    Args:
        config_kw: ``GPTConfig`` keyword arguments.
        batches: ``[(x, y), ...]``, one full global batch per step.
        optimizer: None: forward/backward only; else AdamW keyword arguments of
            :class:`hybrid.zero.config.OptimizerConfig` (same two weight-decay groups as the
            engine, global clip at ``clip_grad``).
        seed: the weights' seed.

    Returns:
        ``losses`` (per step), ``norms`` (pre-clip global gradient L2 norm, float64), ``grads``
        (of the first step), ``initial`` / ``first`` / ``final`` state dicts (before training,
        after step 1, at the end).
    """
    from hybrid.zero.layout import no_weight_decay

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config_kw))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = None
    if optimizer is not None:
        o = optimizer
        decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
        nodecay = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                                 {"params": nodecay, "weight_decay": 0.0}], lr=o["lr"],
                                betas=(o["adam_beta1"], o["adam_beta2"]), eps=o["adam_eps"])
    losses, norms, grads, first = [], [], None, None
    for step, (x, y) in enumerate(batches):
        loss = model(x, y).mean()
        loss.backward()
        # The norm itself in float64: clip_grad_norm_'s fp32 norm-of-norms is off by ~1e-6 here.
        norms.append(math.sqrt(sum(torch.linalg.vector_norm(p.grad, dtype=torch.float64).item() ** 2
                                   for p in model.parameters())))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        if opt is not None:
            clip = optimizer["clip_grad"]
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e30)
            opt.step()
            opt.zero_grad()
        if step == 0:
            first = {k: v.clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, grads=grads, initial=initial, first=first,
                final={k: v.clone() for k, v in model.state_dict().items()})


def build_parallel(grid: ProcessGrid, config_kw: dict, zero: ZeroConfig | None = None,
                   optimizer: OptimizerConfig | None = None, activation: ActivationConfig
                   | None = None, tracker: RNGTracker | None = None, seed: int = SEED,
                   sequence_parallel: bool = False, tp_comm_overlap: bool = False) -> ZeroEngine:
    """The same weights as :func:`reference`, made parallel by
    :func:`hybrid.parallelize.parallelize` (TP plan -> activation checkpointing -> ZeRO) on
    ``grid``; the sections left None keep their defaults."""
    from hybrid.config import GridConfig, PretrainConfig
    from hybrid.parallelize import parallelize

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config_kw))
    sections = {k: v for k, v in dict(zero=zero, optimizer=optimizer, activation=activation).items()
                if v is not None}
    sections["grid"] = GridConfig(tensor_model_parallel_size=grid.tp_size,
                                  sequence_parallel=sequence_parallel,
                                  tp_comm_overlap=tp_comm_overlap)
    return parallelize(model, grid, PretrainConfig(**sections), tracker)
