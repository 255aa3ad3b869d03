"""When the pretraining job saves and how it resumes: ``--save-interval``, the final save,
SIGTERM / ``--exit-duration-in-mins``, and ``--load`` / ``--finetune`` / ``--no-load-*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid.config import PretrainConfig
from hybrid.job.config_checks import Derived

if TYPE_CHECKING:
    from hybrid.metrics import MetricsWriter
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.training import TrainState
    from hybrid.zero.engine import ZeroEngine


class Checkpointer:
    """Saves at ``--save-interval``, at the end, and when SIGTERM / the time limit asks to stop
    (the stop happens without ``--save`` too: it just does not save)."""

    def __init__(self, cfg: PretrainConfig, derived: Derived, engine: ZeroEngine, grid: ProcessGrid,
                 tracker: RNGTracker | None, writer: MetricsWriter):
        from hybrid.job.preemption import StopSignal

        self.ck, self.engine, self.grid, self.tracker, self.writer = cfg.checkpoint, engine, grid, tracker, writer
        self.metadata = dict(_metadata(cfg, derived), wandb_run_id=writer.wandb_run_id)
        # SIGTERM and the time limit stop the run with or without --save (saving only with it)
        self.stop = StopSignal(self.ck.exit_duration_in_mins)
        self.saved_at = None

    def save(self, state: TrainState) -> None:
        from hybrid.checkpoint.shards import save_checkpoint

        if not self.ck.save or self.saved_at == state.iteration:
            return
        save_checkpoint(self.ck.save, state.iteration, self.engine, self.grid, state.counters(), self.metadata,
                        self.tracker, self.ck.save_keep_last)
        self.saved_at = state.iteration
        if self.grid.rank == 0:
            self.writer.print(f" saved checkpoint at iteration {state.iteration} to {self.ck.save}")

    def after_iteration(self, state: TrainState) -> bool:
        """Save when due; True (on every rank) when the run must stop now."""
        if self.ck.save_interval and state.iteration % self.ck.save_interval == 0:
            self.save(state)
        if self.stop.should_stop(self.grid.device):
            self.save(state)
            if self.grid.rank == 0:
                self.writer.print(f" exiting at iteration {state.iteration}: {self.stop.reason()}")
            return True
        return False

    def close(self) -> None:
        self.stop.restore()


def _metadata(cfg: PretrainConfig, derived: Derived) -> dict:
    import dataclasses
    import os

    # absolute, so that export and generation find it from any working directory
    tok = cfg.data.tokenizer_model and os.path.abspath(cfg.data.tokenizer_model)
    return dict(config=cfg.to_dict(), model=dataclasses.asdict(derived.gpt), tokenizer=tok,
                padded_vocab_size=derived.padded_vocab_size, lr_schedule=run_schedule(cfg, derived))


def run_schedule(cfg: PretrainConfig, derived: Derived) -> dict:
    """This run's LR schedule settings (as stored with each checkpoint)."""
    from hybrid.job.resume_checks import schedule_settings

    t = cfg.training
    return schedule_settings(cfg.optimizer.lr, t.min_lr, derived.warmup_iters, derived.decay_iters, t.lr_decay_style)


def lr_schedule(cfg: PretrainConfig, derived: Derived, meta: dict | None, print_fn=None):
    """The run's :class:`hybrid.schedule.LRSchedule`: the checkpoint's on a resume unless
    ``--override-opt-param-scheduler`` or ``--no-load-optim``; ``print_fn`` (rank 0) is told
    which values differ."""
    from hybrid.job.resume_checks import resumed_schedule
    from hybrid.schedule import LRSchedule

    if cfg.checkpoint.no_load_optim:  # as Megatron-LM: no optimizer state, no scheduler state
        meta = None
    settings, diffs = resumed_schedule(run_schedule(cfg, derived), meta, cfg.checkpoint.override_opt_param_scheduler)
    if diffs and print_fn is not None:
        if cfg.checkpoint.override_opt_param_scheduler:
            print_fn(f" LR schedule from this run's flags (--override-opt-param-scheduler; checkpoint -> this "
                     f"run: {', '.join(diffs)})")
        else:
            past = ""
            if cfg.training.train_iters > settings["decay_iters"] and settings["style"] != "constant":
                past = (f"; iterations after {settings['decay_iters']} (the kept schedule's end) run at the "
                        f"checkpoint's min lr {settings['min_lr']:g}")
            print_fn(f" LR schedule kept from the checkpoint (checkpoint -> this run's flags, not used: "
                     f"{', '.join(diffs)}){past} (pass --override-opt-param-scheduler to use this run's)")
    return LRSchedule(settings["lr"], settings["min_lr"], settings["warmup_iters"], settings["decay_iters"],
                      settings["style"])


def resume(cfg: PretrainConfig, engine: ZeroEngine, grid: ProcessGrid, tracker: RNGTracker | None,
           state: TrainState) -> dict | None:
    """Load ``--load``'s latest complete checkpoint (if any) into the engine and the loop state;
    returns its ``metadata.json`` (None when there was none)."""
    from hybrid.checkpoint.directory import latest_iteration
    from hybrid.checkpoint.shards import load_checkpoint

    ck = cfg.checkpoint
    if latest_iteration(ck.load) is None:
        if grid.rank == 0:
            print(f" no checkpoint under --load {ck.load}: starting from "
                  f"{'--init-from-hf ' + ck.init_from_hf if ck.init_from_hf else 'scratch'}", flush=True)
        if ck.init_from_hf:
            init_from_hf(cfg, engine, grid)
        return None
    meta = load_checkpoint(ck.load, engine, grid, tracker, load_optim=not (ck.no_load_optim or ck.finetune),
                           load_rng=not (ck.no_load_rng or ck.finetune))
    if not ck.finetune:
        state.restore(meta["train_state"])
    if grid.rank == 0:
        saved = meta["grid"]
        print(f" loaded checkpoint {ck.load} iteration {meta['iteration']} (saved at tp={saved['tp']} x "
              f"dp={saved['dp']}, ZeRO stage {meta['zero_stage']}); "
              f"{'fine-tuning from iteration 0' if ck.finetune else f'resuming at consumed samples {state.consumed_samples}'}"
              f"; rank 0 read {meta['read']['bytes'] / 2**20:.2f} MiB of it",
              flush=True)
    return None if ck.finetune else meta


def init_from_hf(cfg: PretrainConfig, engine: ZeroEngine, grid: ProcessGrid) -> None:
    """Load ``--init-from-hf``'s weights into the engine (any grid): the ``--finetune`` weight
    path (:func:`hybrid.checkpoint.weights.load_weights`) fed from the Hugging Face directory."""
    from hybrid.checkpoint.weights import load_weights
    from hybrid.hf.weights import HFWeights

    load_weights(engine, HFWeights(cfg.checkpoint.init_from_hf, engine.model.config))
    if grid.rank == 0:
        print(f" loaded weights from --init-from-hf {cfg.checkpoint.init_from_hf}; training from iteration 0",
              flush=True)
