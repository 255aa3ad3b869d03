"""The GPT pretraining job that ``hybrid.pretrain`` (the entry point, which also starts the dry
run) runs: :func:`start`: parse -> validate (before any process group), or launch torchrun;
:func:`train`: grid -> ``parallelize`` (TP plan -> activation checkpointing -> ZeRO) -> data ->
train -> test evaluation -> close. Flags: ``--help``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from typing import TYPE_CHECKING

from hybrid.job.preemption import process_start

process_start()  # --exit-duration-in-mins counts from here at the latest (before torch loads)


from data.split import no_validation_note  # noqa: E402
from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, Job, validate  # noqa: E402
from hybrid.job.datasets import build_datasets, micro_batches  # noqa: E402
from hybrid.job.megatron_flags import default_stage_note  # noqa: E402
from hybrid.torch_profile import profile_notes  # noqa: E402
from hybrid.wandb_names import preflight as wandb_preflight  # noqa: E402

if TYPE_CHECKING:
    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.training import TrainState
    from hybrid.zero.engine import ZeroEngine


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


def header(job: Job) -> str:
    """The run's one-line setup: grid, batch, model, ZeRO stage and precision, and the
    activation-memory options (sequence parallelism, recompute, ZeRO-R P_a / cpu / MD)."""
    cfg = job.cfg
    a = cfg.activation
    act = ["sequence parallel" + (" (TP comm overlapped)" if cfg.grid.tp_comm_overlap else "")
           ] if cfg.grid.sequence_parallel_active else []
    if a.selective_recompute:
        act.append("selective recompute")
    elif a.checkpoint_activations:
        n = a.first_blocks
        act.append("full recompute" + (f" of the first {n} blocks" if n else ""))
        act += [name for name, on in (("Pa", a.partition_activations), ("cpu", a.checkpoint_in_cpu),
                                      ("contiguous", a.contiguous_checkpointing)) if on]
    return (f"{job.summary()} | ZeRO-{cfg.zero.stage} {cfg.zero.precision} | activations: "
            f"{' + '.join(act) or 'all kept'}")


def _checked_job(argv: list[str] | None):
    """Parse and validate the flags, then the checks and notes that come before any process
    group (rank 0 only): wandb's names, the ignored Megatron-LM flags, the default ZeRO stage, a
    --split without validation data, --init-from-hf's dropout. Returns ``(cfg, job)``; raises
    :class:`ConfigError` for a bad flag."""
    ignored, hf_flags, given = [], [], set()  # parse_config fills them
    cfg = parse_config(argv, ignored, hf_flags, given)
    job = validate(cfg, world_size=cfg.dry_run.dry_run_world_size)
    if os.environ.get("RANK", "0") != "0":
        return cfg, job
    if not cfg.dry_run.dry_run_world_size:
        wandb_preflight(cfg.logging.wandb_project, cfg.logging.wandb_entity,
                        cfg.logging.wandb_init_timeout)  # online: refuse a foreign entity
    if ignored:
        print(f"hybrid-pretrain: Megatron-LM flags accepted without effect here (kernel, "
              f"fusion and backend choices): {', '.join(ignored)}", flush=True)
    if note := default_stage_note(given, job.dp):
        print(note, flush=True)
    if cfg.grid.sequence_parallel and not cfg.grid.sequence_parallel_active:
        print("hybrid-pretrain: note: --sequence-parallel has no effect at "
              "--tensor-model-parallel-size 1 (no group to split the sequence over); disabled, as "
              "Megatron-LM disables it", flush=True)
    notes = [*profile_notes(cfg.logging, cfg.training.train_iters),
             no_validation_note(cfg.data.split, cfg.eval.eval_iters)]
    for note in filter(None, notes):
        print(f"hybrid-pretrain: {note}", flush=True)
    if hf_flags:
        print(f"hybrid-pretrain: --init-from-hf {cfg.checkpoint.init_from_hf}: the model flags of "
              f"its config.json: {' '.join(hf_flags)}", flush=True)
    if cfg.checkpoint.init_from_hf:
        from hybrid.hf.weights import start_note  # the run's dropout against config.json's

        note = start_note(cfg.checkpoint.init_from_hf, job.gpt)
        if note:
            print(note, flush=True)
    return cfg, job


def start(argv: list[str] | None = None) -> tuple[PretrainConfig, Job] | int:
    """Before any process group: parse and check the flags (:func:`_checked_job`), or hand a
    ``--nproc-per-node N`` command to torchrun (:mod:`hybrid.job.launch`). Returns ``(cfg,
    job)`` for the entry point (:mod:`hybrid.pretrain`) to train or dry-run, or the exit status:
    torchrun's, or 2 for a bad flag (one line on stderr, from local rank 0 only)."""
    import warnings

    # a user's warning is a line of its own, not a source file and line of this package
    warnings.formatwarning = lambda msg, cat, *_, **__: f"{cat.__name__}: {msg}\n"
    argv = sys.argv[1:] if argv is None else argv
    try:
        from hybrid.job import launch

        if launch.wanted(argv):  # --nproc-per-node N
            return launch.launch(argv)
        return _checked_job(argv)
    except ConfigError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
            print(f"hybrid-pretrain: error: {e}", file=sys.stderr)
        else:  # torchrun stops the whole node when the first worker exits: rank 0 reports first
            time.sleep(3)
        return 2


@contextlib.contextmanager
def torn_down():
    """On leaving (returned or raised), around a training run or a dry run: destroy the process
    group if one started, then free the groups (joining gloo's threads) while Python is whole."""
    import torch.distributed as dist

    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def train(job: Job) -> int:
    """Train a validated job (:func:`run`) and tear the process group down; returns the exit
    status: 0; 2 when another job holds ``--save`` (refused, not failed); 1 when
    ``--max-nan-iterations`` consecutive NaN/inf losses stopped training or a save failed."""
    import torch.distributed as dist

    from hybrid.checkpoint.agree import SaveFailedError
    from hybrid.checkpoint.lock import SaveDirectoryInUseError
    from hybrid.training import TooManyNaNIterations

    with torn_down():
        try:
            run(job)["engine"].close()
        # every rank sees the same mean loss, the same account of a failed save or a lock
        except (TooManyNaNIterations, SaveFailedError, SaveDirectoryInUseError) as e:
            if dist.get_rank() == 0:
                print(f"hybrid-pretrain: error: {e}", file=sys.stderr, flush=True)
            return 2 if isinstance(e, SaveDirectoryInUseError) else 1  # refused, not failed
        if dist.get_world_size() > 1:
            dist.barrier()  # no rank tears down while a peer still communicates
    return 0


def exit_now(status: int) -> None:
    """Flush everything and end the process without interpreter finalization.

    gloo's worker threads can outlive ``destroy_process_group`` (a process group that something
    still references is only shut down, not destroyed); interpreter finalization and C++ static
    destructors then race with them, and one rank in a few dies with ``terminate called without
    an active exception`` (SIGABRT) after a finished run. Every file, metric and wandb record is
    closed by then, so nothing is lost by skipping finalization. Under the launcher, a reported
    failure's status goes to it (:func:`hybrid.job.launch.worker_status`).
    """
    import logging

    from hybrid.job.launch import worker_status

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(worker_status(status))
