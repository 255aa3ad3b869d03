"""The runs of the combination test (``tests/test_combinations.py``): the real job from
Megatron-LM flags, once per configuration, in one spawned world (:func:`run_all`), and the
plain single-process model that is its ground truth (:func:`plain_reference`)."""

from __future__ import annotations


def run_all(rank: int, world: int, runs: list[tuple[list[str], dict[str, str]]]) -> list[dict]:
    """Run ``hybrid.pretrain`` (parse -> validate -> run) for each ``(argv, environment)`` in
    turn on this spawned world; each run's result is ``{"losses", "norms", "skipped",
    "seconds", "cpu"}`` (per iteration: lm loss, pre-clip gradient norm; skipped iterations; wall
    and CPU seconds of the run on this rank) or ``{"error": traceback}``, so that one failing
    configuration does not hide the others. Training prints go to a buffer (per-iteration lines
    of some 40 runs).

    torch.compile's caches are reset before each run, as a job starts in a fresh process: the
    compiled regions of ``--kernel-fusion`` (``fullgraph=True``) would otherwise collect one
    specialisation per shape, dtype and grad mode of every earlier run and hit dynamo's
    recompile limit (8), which fails a ``fullgraph`` region.
    """
    import contextlib
    import io
    import os
    import sys
    import time
    import traceback

    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.run import run

    out = []
    for argv, env in runs:
        os.environ.update(env)
        if "torch._dynamo" in sys.modules:  # imported by the first compiled region only
            sys.modules["torch._dynamo"].reset()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                result = run(validate(parse_config(argv)))
            result["engine"].close()
        except Exception:
            out.append({"error": traceback.format_exc()})
            continue
        train = [r for r in result["history"] if "split" not in r]
        out.append({"losses": [r["lm_loss"] for r in train],
                    "norms": [r["grad_norm"] for r in train],
                    "skipped": sum(r["skipped_iterations"] for r in train),
                    "seconds": time.perf_counter() - start,
                    "cpu": time.process_time() - cpu})
    return out


def plain_reference(argv: list[str]) -> dict:
    """The single-process ground truth of the job ``argv`` (fp32, dropout off, constant LR):
    the plain :class:`models.gpt.GPT` (no TP plan, no ZeRO engine), initialised as the job
    initialises it (``init_weights(--seed)``), trained by ``torch.optim.AdamW`` with Megatron-LM's
    two weight-decay groups and global clipping on the job's own samples (global batch ``i`` is
    samples ``[i gbs, (i + 1) gbs)`` of its training split, with its document layout). Runs in
    the calling process, which needs no process group.

    Returns:
        ``{"losses", "norms"}``: per iteration the mean loss and the pre-clip gradient L2 norm
        (float64).
    """
    import math

    import torch

    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.datasets import build_datasets, eod_id
    from hybrid.training import TrainState
    from hybrid.zero.layout import no_weight_decay
    from models.documents import document_layout
    from models.gpt import GPT

    job = validate(parse_config(argv), world_size=1, local_world_size=1)
    cfg, o, d, gbs = job.cfg, job.cfg.optimizer, job.cfg.data, job.global_batch_size
    assert cfg.training.lr_decay_style == "constant" and job.gpt.hidden_dropout == 0, argv
    model = GPT(job.gpt)
    model.init_weights(d.seed)
    groups = [[p for n, p in model.named_parameters() if no_weight_decay(n, p) == nd]
              for nd in (False, True)]
    opt = torch.optim.AdamW([{"params": groups[0], "weight_decay": o.weight_decay},
                             {"params": groups[1], "weight_decay": 0.0}], lr=o.lr,
                            betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    train = build_datasets(job, TrainState())[0]
    out = {"losses": [], "norms": []}
    for step in range(cfg.training.train_iters):
        tokens = torch.stack([train[i]["tokens"] for i in range(step * gbs, (step + 1) * gbs)])
        tokens = tokens.long()
        docs, _ = document_layout(tokens[:, :-1], eod_id(cfg, job.gpt.vocab_size),
                                  d.reset_position_ids, d.reset_attention_mask, False)
        loss = model(tokens[:, :-1], tokens[:, 1:], documents=docs).mean()
        loss.backward()
        out["losses"].append(loss.item())
        out["norms"].append(math.sqrt(sum(
            torch.linalg.vector_norm(p.grad, dtype=torch.float64).item() ** 2
            for p in model.parameters())))
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad or math.inf)
        opt.step()
        opt.zero_grad()
    return out
