"""When the pretraining job saves and how it starts: ``--save-interval``, the final save,
SIGTERM / ``--exit-duration-in-mins``, and where the starting weights come from (``--load`` /
``--finetune`` / ``--no-load-*``, ``--init-from-hf``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybrid.job.config_checks import Job

if TYPE_CHECKING:
    from hybrid.metrics import MetricsWriter
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.training import TrainState
    from hybrid.zero.engine import ZeroEngine


class Checkpointer:
    """Saves at ``--save-interval``, at the end, and when SIGTERM / the time limit asks to stop
    (the stop happens without ``--save`` too: it just does not save), in ``--ckpt-format``."""

    def __init__(self, job: Job, engine: ZeroEngine, grid: ProcessGrid,
                 tracker: RNGTracker | None, writer: MetricsWriter):
        from hybrid.checkpoint.registry import format_named
        from hybrid.job.preemption import StopSignal

        self.ck, self.engine, self.grid = job.cfg.checkpoint, engine, grid
        self.fmt = format_named(self.ck.ckpt_format)
        self.tracker, self.writer = tracker, writer
        self.metadata = dict(_metadata(job), wandb_run_id=writer.wandb_run_id)
        # SIGTERM and the time limit stop the run with or without --save (saving only with it)
        self.stop = StopSignal(self.ck.exit_duration_in_mins)
        engine.stop_source = self.stop.requested  # rides on the grad-norm all-reduce
        self.saved_at = None
        self.stop_agreed = False  # stop_now() said stop: the next after_iteration stops
        self.retention = retention(job, writer.print if grid.rank == 0 else None)
        self.saver = None
        if self.ck.save and self.ck.async_save:
            from hybrid.checkpoint.async_save import AsyncSaver

            self.saver = AsyncSaver(grid, writer.print if grid.rank == 0 else None, self.fmt)
            self.saver.reserve(engine, tracker)

    def save(self, state: TrainState, report: bool = True, wait: bool = False) -> None:
        """Save ``state``'s iteration under ``--save`` (once per iteration; nothing without
        ``--save``); ``report``: rank 0 prints the saved line. With ``--async-save`` only the
        snapshot happens now; ``wait`` (the end of training, a stop) also waits until it is
        written and published."""
        from hybrid.checkpoint.shards import save_checkpoint

        if self.ck.save and self.saved_at != state.iteration:
            if self.saver is not None:
                self.saver.save(self.ck.save, state.iteration, self.engine, state.counters(),
                                self.metadata, self.tracker, self.retention)
            else:
                save_checkpoint(self.ck.save, state.iteration, self.engine, self.grid,
                                state.counters(), self.metadata, self.tracker, self.retention,
                                self.fmt)
                if self.grid.rank == 0 and report:
                    self.writer.print(f" saved checkpoint at iteration {state.iteration} to "
                                      f"{self.ck.save}")
            self.saved_at = state.iteration
        if wait and self.saver is not None:
            self.saver.wait(report=report)

    def resumed_at(self, iteration: int, train_iters: int | None) -> None:
        """The run resumed at ``iteration``: loaded from its own ``--save``, that iteration is
        held there already, so the end of training does not save it again (a finished run
        started once more would otherwise rewrite its last checkpoint, on another grid when the
        grid changed); with nothing left to train rank 0 says so."""
        if not (self.ck.save and self.ck.load) or iteration == 0:
            return
        if os.path.realpath(self.ck.save) != os.path.realpath(self.ck.load):
            return
        self.saved_at = iteration
        if self.grid.rank == 0 and train_iters and iteration >= train_iters:
            self.writer.print(f" nothing left to train: loaded iteration {iteration} of "
                              f"--train-iters {train_iters}; the checkpoint in {self.ck.save} is "
                              "left as it is")

    def after_iteration(self, state: TrainState) -> bool:
        """Publish a finished background save; save when due; True (on every rank) when the
        run must stop now (the Trainer's ``after_iteration`` hook): a stop signal, the time
        limit, or an iteration that is a multiple of ``--exit-interval``. A stop is one line:
        why, the validation it dropped (a stop during this iteration's evaluation), and where
        the checkpoint is."""
        if self.saver is not None:
            self.saver.poll()
        if self.ck.save_interval and state.iteration % self.ck.save_interval == 0:
            self.save(state)
        reduced = self.engine.take_stop_request()
        every = self.ck.exit_interval  # Megatron-LM's --exit-interval: the same on every rank
        interval = bool(every) and state.iteration % every == 0
        if interval or self.stop_agreed or self.stop.should_stop(self.grid.device, reduced):
            self.save(state, report=False, wait=True)
            if self.grid.rank == 0:
                saved = (f"saved checkpoint at iteration {state.iteration} to {self.ck.save}"
                         if self.ck.save else "not saved (no --save)")
                why = f"reached --exit-interval ({every})" if interval else self.stop.reason()
                if self.stop_agreed:  # stop_now() said stop: during this iteration's evaluation
                    why += f"; dropped the validation at iteration {state.iteration}"
                self.writer.print(f" exiting at iteration {state.iteration}: {why}; {saved}")
            return True
        return False

    def final_evaluation(self, evaluate, state: TrainState) -> None:
        """The end of training's validation and test evaluations (``evaluate(split)``, the
        Trainer's). A stop during one (SIGTERM, time limit: :meth:`stop_now`) drops it and the
        rest, and rank 0 prints one line: what was dropped and where the checkpoint is (saved
        before the evaluations)."""
        for split, dropped in (("valid", "validation and test evaluations"),
                               ("test", "test evaluation")):
            evaluate(split)
            if self.stop_agreed:
                if self.grid.rank == 0:
                    saved = (f"the checkpoint at iteration {state.iteration} in {self.ck.save} "
                             "was saved before them" if self.ck.save else "no --save")
                    self.writer.print(f" exiting at iteration {state.iteration}: "
                                      f"{self.stop.reason()}; dropped the final {dropped}; "
                                      f"{saved}")
                return

    def stop_now(self) -> bool:
        """The world's answer (one all-reduce): must the job stop now? The Trainer asks it
        between evaluation batches; once True, the next :meth:`after_iteration` saves and stops
        without asking again."""
        self.stop_agreed = self.stop_agreed or self.stop.should_stop(self.grid.device)
        return self.stop_agreed

    def close(self) -> None:
        """Reinstall the signal handlers the stop signal replaced; a background save still
        pending here (training failed) is left unpublished."""
        self.stop.restore()
        if self.saver is not None:
            self.saver.abandon()


def lock_save_dir(job: Job, grid: ProcessGrid):
    """Lock ``--save`` for this job before training (collective; global rank 0 holds
    :class:`hybrid.checkpoint.lock.SaveLock`, and prints a note when it took over a dead job's
    lock). Returns the lock on rank 0, None elsewhere or without ``--save``.

    Raises:
        hybrid.checkpoint.lock.SaveDirectoryInUseError: on every rank, when a live job holds
            the directory (naming its host, pid and start time) or it cannot be locked.
    """
    import torch.distributed as dist

    from hybrid.checkpoint.lock import INHERIT_ENV, SaveDirectoryInUseError, SaveLock

    if not job.cfg.checkpoint.save:
        return None
    lock, outcome = None, [None]
    if grid.rank == 0:
        try:  # a lock our launcher took for this job is ours (INHERIT_ENV)
            lock = SaveLock(job.cfg.checkpoint.save, inherit=os.environ.get(INHERIT_ENV))
            if lock.note:
                print(f" --save {job.cfg.checkpoint.save}: {lock.note}", flush=True)
        except (SaveDirectoryInUseError, OSError) as e:
            outcome = [f"{e}" if isinstance(e, SaveDirectoryInUseError)
                       else f"cannot lock --save {job.cfg.checkpoint.save}: {e}"]
    if grid.world_size > 1:
        dist.broadcast_object_list(outcome, src=0, device=grid.device)
    if outcome[0] is not None:
        raise SaveDirectoryInUseError(outcome[0])
    return lock


def retention(job: Job, print_fn=None):
    """``--save-keep-last``'s policy for this job (None: keep all), fixed at its start: the
    checkpoint resumed from ``--save`` (when ``--load`` is the same directory) and those
    before it in save order may be pruned with the job's own, never those saved after it
    (:mod:`hybrid.checkpoint.retention`). ``print_fn`` (rank 0) is told which are kept apart."""
    from hybrid.checkpoint.directory import latest_iteration
    from hybrid.checkpoint.retention import Retention, same_directory

    ck = job.cfg.checkpoint
    if not (ck.save and ck.save_keep_last):
        return None
    resumed = latest_iteration(ck.load) if same_directory(ck.load, ck.save) else None
    policy = Retention.at_start(ck.save, ck.save_keep_last, resumed)
    line = policy.kept_apart_line(ck.save, resumed, job.cfg.training.train_iters)
    if line and print_fn is not None:
        print_fn(line)
    return policy


def _metadata(job: Job) -> dict:
    import dataclasses
    import os

    cfg = job.cfg
    # absolute, so that export and generation find it from any working directory
    tok = cfg.data.tokenizer_model and os.path.abspath(cfg.data.tokenizer_model)
    return dict(config=cfg.to_dict(), model=dataclasses.asdict(job.gpt), tokenizer=tok,
                padded_vocab_size=job.padded_vocab_size, lr_schedule=job.schedule)


def lr_schedule(job: Job, meta: dict | None, print_fn=None):
    """``(schedule, settings)``: the run's :class:`hybrid.schedule.ParamSchedule` and its
    settings (what later checkpoints store): this run's flags, or the checkpoint's
    schedule with ``--use-checkpoint-opt_param-scheduler`` (a difference without either flag was
    refused before); ``--no-load-optim`` and ``--finetune`` start it anew. ``print_fn`` (rank 0)
    is told which values differ."""
    from hybrid.job.schedule_setup import (
        build_schedule,
        differences,
        resumed_settings,
        saved_settings,
    )

    ck = job.cfg.checkpoint
    saved = None if ck.no_load_optim else saved_settings(meta)
    diffs = [] if saved is None else differences(saved, job.schedule)
    settings = resumed_settings(job.schedule, saved, ck.use_checkpoint_opt_param_scheduler)
    if diffs and print_fn is not None:
        which = ("kept from the checkpoint (--use-checkpoint-opt_param-scheduler)"
                 if ck.use_checkpoint_opt_param_scheduler
                 else "from this run's flags (--override-opt-param-scheduler)")
        print_fn(f" LR schedule {which}; checkpoint -> this run: {'; '.join(diffs)}")
    return build_schedule(settings), settings


def start_from(job: Job, engine: ZeroEngine, grid: ProcessGrid, tracker: RNGTracker | None,
               state: TrainState) -> dict | None:
    """Load the starting weights, decided here only: ``--load``'s latest complete checkpoint
    when there is one (into the engine and, unless ``--finetune``, the loop state ``state``),
    else ``--init-from-hf``'s weights, else none (the model's own initialisation).

    Returns:
        the resumed checkpoint's ``metadata.json``; None when the run starts at iteration 0.
    """
    from hybrid.checkpoint.directory import latest_iteration

    ck = job.cfg.checkpoint
    if ck.load and latest_iteration(ck.load) is not None:
        return _resume(job, engine, grid, tracker, state)
    if ck.load and grid.rank == 0:
        origin = "--init-from-hf " + ck.init_from_hf if ck.init_from_hf else "scratch"
        print(f" no checkpoint under --load {ck.load}: starting from {origin}", flush=True)
    if ck.init_from_hf:
        _init_from_hf(job, engine, grid)
    return None


def _resume(job: Job, engine: ZeroEngine, grid: ProcessGrid, tracker: RNGTracker | None,
            state: TrainState) -> dict | None:
    """Load ``--load``'s latest complete checkpoint into the engine and the loop state; returns
    its ``metadata.json`` (None with ``--finetune``: a new run from iteration 0)."""
    from hybrid.checkpoint.shards import load_checkpoint

    ck = job.cfg.checkpoint
    meta = load_checkpoint(ck.load, engine, grid, tracker,
                           load_optim=not (ck.no_load_optim or ck.finetune),
                           load_rng=not (ck.no_load_rng or ck.finetune))
    if not ck.finetune:
        state.restore(meta["train_state"], job.global_batch_size)
        if ck.no_load_optim:  # as Megatron-LM: no scheduler state loaded, the schedule restarts
            state.scheduler_samples = 0
    if grid.rank == 0:
        saved = meta["grid"]
        start = ("fine-tuning from iteration 0" if ck.finetune
                 else f"resuming at consumed samples {state.consumed_samples}")
        print(f" loaded checkpoint {ck.load} iteration {meta['iteration']} (saved at "
              f"tp={saved['tp']} x dp={saved['dp']}, ZeRO stage {meta['zero_stage']}); {start}; "
              f"rank 0 read {meta['read']['bytes'] / 2**20:.2f} MiB of it", flush=True)
    return None if ck.finetune else meta


def _init_from_hf(job: Job, engine: ZeroEngine, grid: ProcessGrid) -> None:
    """Load ``--init-from-hf``'s weights into the engine (any grid): the ``--finetune`` weight
    path (:func:`hybrid.checkpoint.weights.load_weights`) fed from the Hugging Face directory."""
    from hybrid.checkpoint.weights import load_weights
    from hybrid.hf.weights import HFWeights

    hf_dir = job.cfg.checkpoint.init_from_hf
    load_weights(engine, HFWeights(hf_dir, engine.model.config))
    if grid.rank == 0:
        print(f" loaded weights from --init-from-hf {hf_dir}; training from iteration 0",
              flush=True)
