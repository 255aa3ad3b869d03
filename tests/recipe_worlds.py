"""Worlds and single-process references of Megatron-LM's optimizer and loss recipes
(``--decoupled-lr`` / ``--decoupled-min-lr``, ``--calculate-per-token-loss`` and a loss mask).

The reference is the plain GPT with ``torch.optim.AdamW`` on parameter groups written out here
(decay / no decay x embedding-or-output / rest, each at its own schedule) and the loss weighting
written out per token, on the whole global batch at once; the world runs
:func:`hybrid.training.train_step` on a ZeRO engine over the grid. Nothing of the engine's
grouping or weighting is reused by the reference.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hybrid.parallel.grid import ProcessGrid
from hybrid.schedule import LRSchedule
from hybrid.training import train_step
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from models.gpt import GPT, GPTConfig
from tests.tiny import SEED, build_parallel, make_batch, tiny_config

CFG = tiny_config(untie_embeddings_and_output_weights=True)
GBS, SEQ, MICRO, STEPS = 8, 16, 2, 10
OPT = dict(lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6,
           clip_grad=1.0)
LR = LRSchedule(3e-3, 3e-4, warmup_steps=2 * GBS, decay_steps=STEPS * GBS, style="cosine")
DECOUPLED = dataclasses.replace(LR, lr=6e-3, min_lr=6e-4)
MODES = ("decoupled", "masked", "per_token")
"""``decoupled``: --decoupled-lr, no mask; ``masked``: a loss mask, Megatron-LM's default mean of
micro-batch means; ``per_token``: a loss mask with --calculate-per-token-loss."""


def global_batch(step: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [GBS, SEQ + 1], loss_mask [GBS, SEQ])``: learnable tokens and a mask whose
    count differs a lot between sequences (so between micro-batches and ranks)."""
    x, y = make_batch(500 + step, GBS, SEQ, CFG["vocab_size"], motif=True)
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    if not masked:
        return tokens, torch.ones(GBS, SEQ)
    g = torch.Generator().manual_seed(900 + step)
    keep = torch.linspace(0.15, 0.95, GBS)[torch.randperm(GBS, generator=g)]
    return tokens, (torch.rand(GBS, SEQ, generator=g) < keep[:, None]).float()


def chunk(step: int, masked: bool, dp_rank: int, dp: int, m: int) -> tuple:
    """The sequences of data-parallel rank ``dp_rank``'s micro-batch ``m``."""
    tokens, mask = global_batch(step, masked)
    per = GBS // (dp * MICRO)
    lo = (m * dp + dp_rank) * per
    return tokens[lo:lo + per], mask[lo:lo + per]


def _groups(model: GPT, decoupled: bool) -> list[dict]:
    groups = {}
    for name, p in model.named_parameters():
        nodecay = p.dim() < 2 or name.endswith("bias")
        embedding_or_output = decoupled and name in ("wte.weight", "lm_head.weight")
        groups.setdefault((nodecay, embedding_or_output), []).append(p)
    return [{"params": ps, "weight_decay": 0.0 if nd else OPT["weight_decay"], "dec": dec}
            for (nd, dec), ps in groups.items()]


def reference(mode: str, dp: int = 2) -> dict:
    """The single-process run: ``losses`` (as logged: masked sum over unmasked count of the
    global batch) and ``final`` weights."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(_groups(model, mode == "decoupled"), lr=OPT["lr"],
                            betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"])
    losses = []
    for step in range(STEPS):
        tokens, mask = global_batch(step, mode != "decoupled")
        per_label = model(tokens[:, :-1], tokens[:, 1:])
        if mode == "masked":  # Megatron-LM's default: the mean of the micro-batch means
            per = GBS // (dp * MICRO)
            means = [(per_label[i:i + per] * mask[i:i + per]).sum() / mask[i:i + per].sum()
                     for i in range(0, GBS, per)]
            loss = torch.stack(means).mean()
        else:
            loss = (per_label * mask).sum() / mask.sum()
        loss.backward()
        losses.append(((per_label * mask).sum() / mask.sum()).item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"])
        n = step * GBS
        for g in opt.param_groups:
            g["lr"] = DECOUPLED(n) if g["dec"] else LR(n)
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, final={k: v.clone() for k, v in model.state_dict().items()})


def _run(grid: ProcessGrid, stage: int, mode: str) -> dict:
    engine = build_parallel(grid, CFG, zero=ZeroConfig(stage=stage, param_persistence_threshold=100,
                                                       reduce_bucket_size=20_000,
                                                       allgather_bucket_size=20_000),
                            optimizer=OptimizerConfig(**OPT))
    losses = []
    for step in range(STEPS):
        batches = []
        for m in range(MICRO):
            tokens, mask = chunk(step, mode != "decoupled", grid.dp_rank, grid.dp_size, m)
            batches.append(tokens if mode == "decoupled" else {"tokens": tokens,
                                                               "loss_mask": mask})
        n = step * GBS
        r = train_step(engine, batches, LR(n), grid, None,
                       DECOUPLED(n) if mode == "decoupled" else None, mode == "per_token")
        assert not r.skipped and math.isfinite(r.loss)
        losses.append(r.loss)
    final = engine.model_state_dict_full()
    engine.close()
    return dict(losses=losses, final=final if grid.rank == 0 else None)


def world4(rank: int, world: int) -> dict:
    """tp2 x dp2, every ZeRO stage, every mode."""
    grid = ProcessGrid(tp=2)
    return {(stage, mode): _run(grid, stage, mode) for stage in range(4) for mode in MODES}
