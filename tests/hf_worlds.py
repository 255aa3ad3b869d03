"""World function of the Hugging Face tests: train or import through ``hybrid.job.pretrain.run``,
then evaluate the distributed model on a fixed batch."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _logits_and_loss(engine, grid, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logits ``[b, s, V]`` (TP shards gathered, padding dropped) and
    per-token losses ``[b, s]`` of the distributed model on ``tokens [b, s + 1]``."""
    engine.eval()
    x, y = tokens[:, :-1].to(grid.device), tokens[:, 1:].to(grid.device)
    local = engine.model(x).detach()
    parts = [torch.empty_like(local) for _ in range(grid.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=grid.tp_group)
    logits = torch.cat(parts, dim=-1)[..., :engine.model.config.vocab_size]
    losses = engine.model(x, y).detach()
    engine.train()
    return logits.cpu(), losses.cpu()


def run_and_evaluate(rank: int, world: int, argvs: list[list[str]],
                     tokens: torch.Tensor) -> list[dict]:
    """For each argv: run ``hybrid.pretrain`` to the end, then the fixed-batch logits and losses
    (returned from global rank 0 only; the others return their logged history)."""
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.pretrain import run

    out = []
    for argv in argvs:
        cfg = parse_config(argv)
        result = run(validate(cfg))
        logits, losses = _logits_and_loss(result["engine"], result["engine"].grid, tokens)
        out.append(dict(history=result["history"], logits=logits if rank == 0 else None,
                        losses=losses if rank == 0 else None))
    return out
