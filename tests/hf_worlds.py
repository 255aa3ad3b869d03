"""World function of the Hugging Face tests: train or import through ``hybrid.job.run.run``,
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
    from hybrid.job.run import run

    out = []
    for argv in argvs:
        cfg = parse_config(argv)
        result = run(validate(cfg))
        logits, losses = _logits_and_loss(result["engine"], result["engine"].grid, tokens)
        out.append(dict(history=result["history"], logits=logits if rank == 0 else None,
                        losses=losses if rank == 0 else None))
    return out


def import_export_peaks(rank: int, world: int, hf_dir: str, model_kw: dict, root: str) -> dict:
    """Resident-set peaks (``VmHWM`` above the resident set just before) of ``--init-from-hf``'s
    weight load into a tp1 x dp``world`` ZeRO-3 engine on every rank, and of ``export_hf`` of the
    saved checkpoint on rank 0; with the largest unit and the largest tensor (fp32 bytes)."""
    import dataclasses
    import os

    from hybrid.checkpoint.shards import save_checkpoint
    from hybrid.checkpoint.weights import load_weights
    from hybrid.hf.export import export_hf
    from hybrid.hf.weights import HFWeights
    from hybrid.parallel.grid import ProcessGrid
    from scripts.bench_checkpoint import _engine, _release_freed_memory, _reset_peak, _status

    _release_freed_memory()
    grid = ProcessGrid(tp=1)
    engine = _engine(grid, model_kw, stage=3)
    source = HFWeights(hf_dir, engine.model.config)
    sizes = [4 * p.numel() for p in engine.model.parameters()]
    before = _reset_peak()
    load_weights(engine, source)
    out = dict(import_peak=_status("VmHWM") - before, unit=4 * max(
        u.padded for u in engine.layout.units), largest=max(sizes), model=sum(sizes))
    meta = {"model": dataclasses.asdict(engine.model.config)}
    save_checkpoint(root, 1, engine, grid, {"iteration": 1}, meta)
    del engine
    dist.barrier()
    if rank == 0:  # a first export pays the one-time imports (transformers, torch's meta ops)
        export_hf(root, os.path.join(root, "hf_warm"), max_shard_size="20MB")
        out["export_peak"] = anon_peak(lambda: export_hf(root, os.path.join(root, "hf"),
                                                         max_shard_size="20MB"))
        # the sampler sees an allocation of the model's size held as briefly as a tensor is
        out["sampler_check"] = anon_peak(lambda: torch.ones(out["model"] // 4).sum())
    return out


def anon_peak(fn, interval_s: float = 2e-4) -> int:
    """Peak of the anonymous resident set (``RssAnon``: allocations, not the checkpoint files'
    memory-mapped pages, which the kernel may drop at any time) above its value before
    ``fn()``, sampled every ``interval_s`` by a thread."""
    import gc
    import threading

    from scripts.bench_checkpoint import _status

    gc.collect()
    before, peak, done = _status("RssAnon"), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            done.wait(interval_s)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], _status("RssAnon")) - before
