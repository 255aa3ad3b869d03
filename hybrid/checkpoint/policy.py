"""When the pretraining job saves and how it resumes: ``--save-interval``, the final save,
SIGTERM / ``--exit-duration-in-mins``, and ``--load`` / ``--finetune`` / ``--no-load-*``."""

from __future__ import annotations

from hybrid.config import PretrainConfig
from hybrid.config_checks import Derived


class Checkpointer:
    """Saves at ``--save-interval``, at the end, and when SIGTERM / the time limit asks to stop."""

    def __init__(self, cfg: PretrainConfig, derived: Derived, engine, grid, tracker, writer):
        from hybrid.checkpoint.preemption import StopSignal

        self.ck, self.engine, self.grid, self.tracker, self.writer = cfg.checkpoint, engine, grid, tracker, writer
        self.metadata = _metadata(cfg, derived)
        self.stop = StopSignal(self.ck.exit_duration_in_mins) if self.ck.save else None
        self.saved_at = None

    def save(self, state) -> None:
        from hybrid.checkpoint.shards import save_checkpoint

        if not self.ck.save or self.saved_at == state.iteration:
            return
        save_checkpoint(self.ck.save, state.iteration, self.engine, self.grid, state.counters(), self.metadata,
                        self.tracker, self.ck.save_keep_last)
        self.saved_at = state.iteration
        if self.grid.rank == 0:
            self.writer.print(f" saved checkpoint at iteration {state.iteration} to {self.ck.save}")

    def after_iteration(self, state) -> bool:
        """Save when due; True (on every rank) when the run must stop now."""
        if self.ck.save_interval and state.iteration % self.ck.save_interval == 0:
            self.save(state)
        if self.stop is not None and self.stop.should_stop(self.grid.device):
            self.save(state)
            if self.grid.rank == 0:
                self.writer.print(f" exiting at iteration {state.iteration}: {self.stop.reason()}")
            return True
        return False

    def close(self) -> None:
        if self.stop is not None:
            self.stop.restore()


def _metadata(cfg: PretrainConfig, derived: Derived) -> dict:
    import dataclasses

    return dict(config=cfg.to_dict(), model=dataclasses.asdict(derived.gpt), tokenizer=cfg.data.tokenizer_model,
                padded_vocab_size=derived.padded_vocab_size)


def resume(cfg: PretrainConfig, engine, grid, tracker, state) -> None:
    """Load ``--load``'s latest complete checkpoint (if any) into the engine and the loop state."""
    from hybrid.checkpoint.directory import latest_iteration
    from hybrid.checkpoint.shards import load_checkpoint

    ck = cfg.checkpoint
    if latest_iteration(ck.load) is None:
        if grid.rank == 0:
            print(f" no checkpoint under --load {ck.load}: starting from "
                  f"{'--init-from-hf ' + ck.init_from_hf if ck.init_from_hf else 'scratch'}", flush=True)
        if ck.init_from_hf:
            init_from_hf(cfg, engine, grid)
        return
    meta = load_checkpoint(ck.load, engine, grid, tracker, load_optim=not (ck.no_load_optim or ck.finetune),
                           load_rng=not (ck.no_load_rng or ck.finetune))
    if not ck.finetune:
        state.restore(meta["train_state"])
    if grid.rank == 0:
        saved = meta["grid"]
        print(f" loaded checkpoint {ck.load} iteration {meta['iteration']} (saved at tp={saved['tp']} x "
              f"dp={saved['dp']}, ZeRO stage {meta['zero_stage']}); "
              f"{'fine-tuning from iteration 0' if ck.finetune else f'resuming at consumed samples {state.consumed_samples}'}",
              flush=True)


def init_from_hf(cfg: PretrainConfig, engine, grid) -> None:
    """Load ``--init-from-hf``'s weights into the engine (any grid): the ``--finetune`` weight
    path (:func:`hybrid.checkpoint.weights.load_weights`) fed from the Hugging Face directory."""
    from hybrid.checkpoint.weights import load_weights
    from hybrid.hf.weights import HFWeights

    load_weights(engine, HFWeights(cfg.checkpoint.init_from_hf, engine.model.config))
    if grid.rank == 0:
        print(f" loaded weights from --init-from-hf {cfg.checkpoint.init_from_hf}; training from iteration 0",
              flush=True)
