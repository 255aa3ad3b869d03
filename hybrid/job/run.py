"""The run of a validated job (:func:`run`): the process groups and the parallel model with its
ZeRO engine (``parallelize``: TP plan -> activation checkpointing -> ZeRO), the checkpoint to
start from, the data, the metrics path and the loop (:class:`hybrid.training.Trainer`), then the
final save and test evaluation; everything it opened is closed on the way out, returned or
raised. :mod:`hybrid.job.pretrain` runs it and turns its outcome into the exit status.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from hybrid.job.datasets import build_datasets, micro_batches
from hybrid.job.startup_notes import header

if TYPE_CHECKING:
    from hybrid.job.config_checks import Job
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.training import TrainState
    from hybrid.zero.engine import ZeroEngine


def run(job: Job) -> dict:
    """Train a validated job; returns ``{"history": records, "engine": engine}``."""
    from hybrid.job.checkpointing import Checkpointer, lock_save_dir, lr_schedule, start_from
    from hybrid.job.cpu_precision import warn_if_slow
    from hybrid.training import Trainer, TrainState
    from hybrid.zero.accounting import engine_line

    grid, tracker, engine = _build(job)
    if grid.rank == 0:  # once per job: bf16/fp16 without native CPU support is 4.7-7x slower
        warn_if_slow(engine.config.precision, grid.device.type)  # (and true fp32 on CUDA)
    lock = lock_save_dir(job, grid)  # a second job on --save is refused here, before training
    state = TrainState()
    meta = start_from(job, engine, grid, tracker, state)
    train_ds, valid_ds, test_ds = build_datasets(job, state)
    eval_sets = {"valid": valid_ds, "test": test_ds}

    def eval_batches(split, consumed):
        ds = eval_sets[split]
        return None if ds is None else micro_batches(ds, consumed, job, grid)

    schedule, settings = lr_schedule(job, meta, print if grid.rank == 0 else None)
    writer, progress = _metrics(job, grid, state, meta)
    if grid.rank == 0:
        where = f" | resolved config: {writer.config_file}" if writer.config_file else ""
        writer.print(f"{engine_line(engine)} | {engine.kernel_fusion_note}{where}")
    checkpointer = Checkpointer(job, engine, grid, tracker, writer)
    checkpointer.metadata["lr_schedule"] = settings  # the one followed, for the next resume
    if meta is not None:
        checkpointer.resumed_at(state.iteration, job.cfg.training.train_iters)
    loop = loop_settings(job, grid, tuple(k for k, ds in eval_sets.items() if ds is not None))
    trainer = Trainer(engine, grid, loop, schedule, writer, eval_batches,
                      checkpointer.after_iteration, progress, state, checkpointer.stop_now,
                      profiler=_profiler(job, grid))
    try:
        trainer.train(micro_batches(train_ds, state.consumed_samples, job, grid))
        checkpointer.save(state, wait=True)  # --async-save: written and published here
        if trainer.settings.eval_iters and state.iteration >= job.cfg.training.train_iters:
            checkpointer.final_evaluation(trainer.evaluate, state)
    finally:
        if trainer.profiler is not None:  # a run that stopped early still writes its trace
            trainer.profiler.close()
        if progress is not None:
            progress.close()
        writer.close()
        checkpointer.close()
        if lock is not None:
            lock.release()
    return {"history": state.history, "engine": engine}


def _build(job: Job) -> tuple[ProcessGrid, RNGTracker, ZeroEngine]:
    """Start the process groups and build the parallel model and its ZeRO engine."""
    from hybrid.parallel.grid import ProcessGrid, init_distributed
    from hybrid.parallel.rng import RNGTracker, seed_everything
    from hybrid.parallelize import meta_gpt, parallelize

    cfg = job.cfg
    init_distributed(timeout_s=60 * cfg.grid.distributed_timeout_minutes)
    grid = ProcessGrid(tp=job.tp)
    seed_everything(cfg.data.seed, grid.device)
    tracker = RNGTracker(cfg.data.seed, grid.tp_rank, grid.device)
    if grid.rank == 0:
        print(f"hybrid-zero pretraining | {header(job)}", flush=True)
    engine = parallelize(meta_gpt(job.gpt), grid, cfg, tracker)
    if cfg.logging.profile_phases:
        from hybrid.zero.profile import PhaseTimer

        engine.set_profiler(PhaseTimer(grid.device))
    return grid, tracker, engine


def _metrics(job: Job, grid: ProcessGrid, state: TrainState, meta: dict | None):
    """``(writer, progress)``: the metrics path (continuing a resumed run's wandb run) and, on
    rank 0 at a terminal, a progress bar (None otherwise)."""
    from hybrid.metrics import MetricsWriter

    cfg, lg = job.cfg, job.cfg.logging
    progress = None
    if grid.rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=cfg.training.train_iters, initial=state.iteration, desc="train",
                        unit="it", dynamic_ncols=True)
    writer = MetricsWriter(
        grid.rank, lg.metrics_file, cfg.to_dict(), lg.wandb_project, lg.wandb_exp_name,
        lg.wandb_save_dir, print_fn=progress.write if progress else print,
        wandb_init_timeout=lg.wandb_init_timeout,
        wandb_run_id=(meta or {}).get("wandb_run_id"), start_iteration=state.iteration,
        wandb_entity=lg.wandb_entity)
    if lg.tensorboard_dir:
        from hybrid.tensorboard_log import TensorBoardMetrics

        writer = TensorBoardMetrics(writer, lg.tensorboard_dir, grid.rank)
    return writer, progress


def _profiler(job: Job, grid: ProcessGrid):
    """``--profile``'s :class:`hybrid.torch_profile.IterationProfiler` on a rank of
    ``--profile-ranks`` (all by default); None otherwise."""
    lg = job.cfg.logging
    if not lg.profile or (lg.profile_ranks and grid.rank not in lg.profile_ranks):
        return None
    from hybrid.torch_profile import IterationProfiler, trace_dir

    return IterationProfiler(lg.profile_step_start, lg.profile_step_end, grid.rank,
                             trace_dir(lg.tensorboard_dir),
                             cuda_range=grid.device.type == "cuda" and not lg.use_pytorch_profiler,
                             print_fn=print)


def loop_settings(job: Job, grid: ProcessGrid, splits=("valid", "test")):
    """The loop's counts and the FLOPs per step for TFLOP/s and MFU, counted as Megatron-LM's
    ``--log-throughput`` (:func:`hybrid.flops.megatron_flops_per_iteration`). ``splits``: the
    evaluation splits that hold samples; one left out (empty, or skipped as empty) is never
    evaluated, so the ETA does not count it (no validation split: no evaluation in the loop)."""
    from hybrid.flops import device_peak_tflops, megatron_flops_per_iteration
    from hybrid.training import LoopSettings

    cfg, o = job.cfg, job.cfg.training
    return LoopSettings(
        train_iters=o.train_iters, grad_accum_steps=job.grad_accum_steps,
        global_batch_size=job.global_batch_size, tokens_per_step=job.tokens_per_step,
        log_interval=cfg.logging.log_interval,
        eval_interval=cfg.eval.eval_interval if "valid" in splits else None,
        eval_iters=cfg.eval.eval_iters, max_nan_iterations=o.max_nan_iterations,
        flops_per_step=megatron_flops_per_iteration(job.gpt, job.global_batch_size,
                                                    cfg.model.seq_length, job.padded_vocab_size),
        peak_tflops=device_peak_tflops() if grid.device.type == "cuda" else None,
        batch_size=job.rampup.batch_size if job.rampup else None,
        per_token_loss=o.calculate_per_token_loss,
        final_evaluations=len(splits),  # after the loop (none without --eval-iters)
    )
