"""The training loop: micro-batch accumulation, the optimizer step, evaluation and metrics.

A :class:`Trainer` carries what every step needs (engine, grid, loop settings, LR schedule,
metrics writer, the job's ``after_iteration`` hook). ``train_step`` runs one optimizer step over
``grad_accum_steps`` micro-batches; :meth:`Trainer.train` repeats it with the LR schedule, logs
every ``log_interval`` steps, evaluates on the validation split every ``eval_interval`` steps,
and stops with a clear error after too many consecutive NaN/inf losses. Losses are the
data-parallel mean (identical on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybrid.metrics import MetricsWriter, interval_memory
from hybrid.train_step import StepResult, _dp_mean, per_label_losses, train_step, unpack
from hybrid.zero.profile import NULL_TIMER

__all__ = ["StepResult", "train_step"]  # hybrid.training.train_step, as before the move

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.zero.engine import ZeroEngine


class TooManyNaNIterations(RuntimeError):
    """Raised after ``max_nan_iterations`` consecutive iterations whose loss was NaN/inf."""


@dataclass
class TrainState:
    """Progress counters (what a checkpoint must restore for an exact resume)."""

    iteration: int = 0
    """Optimizer steps attempted (including skipped ones)."""
    consumed_samples: int = 0
    """Training samples consumed by all ranks together."""
    successful_steps: int = 0
    """Steps that updated the weights."""
    consumed_valid_samples: int = 0
    """Validation samples read by the evaluations so far: each evaluation continues where the
    last one stopped, as Megatron-LM's."""
    scheduler_samples: int = 0
    """Samples of the steps that updated the weights: the LR schedule's index (Megatron-LM's
    ``OptimizerParamScheduler.num_steps``)."""
    skipped_iterations: int = 0
    """Steps skipped for fp16 overflow or a NaN/inf loss, since the start of training; the log
    records count them per log interval, as Megatron-LM does."""
    nan_iterations: int = 0
    """Steps whose loss was NaN/inf, since the start of training (per log interval in the
    records)."""
    consecutive_nan: int = 0
    history: list = field(default_factory=list)

    COUNTERS = ("iteration", "consumed_samples", "successful_steps", "skipped_iterations",
                "nan_iterations", "scheduler_samples", "consumed_valid_samples")

    def counters(self) -> dict:
        """The counters a checkpoint stores (JSON-able)."""
        return {k: getattr(self, k) for k in self.COUNTERS}

    def restore(self, counters: dict, global_batch_size: int = 0) -> None:
        """Set the counters from a checkpoint's; one saved before ``scheduler_samples`` existed
        had ``successful_steps`` steps of ``global_batch_size`` samples."""
        counters = dict(counters)
        counters.setdefault("scheduler_samples", int(counters["successful_steps"])
                            * global_batch_size)
        counters.setdefault("consumed_valid_samples", 0)
        for k in self.COUNTERS:
            setattr(self, k, int(counters[k]))


@torch.no_grad()
def evaluate(engine: ZeroEngine, batches: Iterator[torch.Tensor], num_micro_batches: int,
             grid: ProcessGrid, stop: Callable[[], bool] | None = None) -> float | None:
    """Mean loss over ``num_micro_batches`` micro-batches of this rank, averaged over dp.

    ``stop()`` (the same answer on every rank, e.g. SIGTERM) is asked after each micro-batch;
    when it says stop the evaluation ends there and returns None (a partial mean is dropped).
    """
    engine.eval()
    # accumulated on the device: a host copy per micro-batch would wait for its forward
    total = torch.zeros(1, dtype=torch.float64, device=grid.device)
    sums = torch.zeros(2, dtype=torch.float64, device=grid.device)  # masked sum, unmasked count
    count, masked = 0, False
    for _ in range(num_micro_batches):
        try:
            tokens, mask, docs = unpack(next(batches), grid.device)
        except StopIteration:
            break
        per_label = per_label_losses(engine.model, tokens, docs)
        if mask is None:
            total += per_label.mean().double()
        else:
            masked = True
            sums += torch.stack([(per_label.float() * mask).sum(), mask.sum()]).double()
        count += 1
        if stop is not None and stop():
            engine.train()
            return None
    engine.train()
    if count == 0:
        return float("nan")
    if masked:  # Megatron-LM: the masked sum over the unmasked count, across dp
        if grid.dp_size > 1:
            dist.all_reduce(sums, group=grid.dp_group)
        return (sums[0] / sums[1]).item()
    return _dp_mean(total / count, grid.dp_group, grid.dp_size).item()


@dataclass
class _LogWindow:
    """The iterations since the last log record, as Megatron-LM's log line counts them."""

    # time.perf_counter is looked up per call: the tests patch the module's time
    t0: float = field(default_factory=lambda: time.perf_counter())
    steps: int = 0
    skipped: int = 0
    nan: int = 0
    samples: int = 0
    """Training samples of the window's iterations."""
    last_batch: int = 0
    """The global batch of its last iteration."""
    losses: list[float] = field(default_factory=list)
    """Losses of the iterations that updated the weights."""
    skipped_losses: list[float] = field(default_factory=list)
    """Finite losses of skipped iterations (fp16 overflow)."""

    def mean_loss(self) -> float:
        """Mean loss of the updating iterations; of the skipped ones in a window where every
        iteration was skipped (the fp16 loss-scale search); NaN when none was finite."""
        losses = self.losses or self.skipped_losses
        return sum(losses) / len(losses) if losses else float("nan")


@dataclass
class LoopSettings:
    """What :func:`train` needs from the config (all counts in optimizer steps)."""

    train_iters: int
    grad_accum_steps: int
    global_batch_size: int
    tokens_per_step: int
    log_interval: int
    eval_interval: int | None
    """None: no evaluation during training (Megatron-LM's default), only at its end."""
    eval_iters: int
    max_nan_iterations: int
    flops_per_step: float
    """Model FLOPs of one optimizer step as Megatron-LM counts them
    (:func:`hybrid.flops.megatron_flops_per_iteration`), for TFLOP/s per device."""
    peak_tflops: float | None
    """Device peak for MFU, None when unknown (CPU)."""
    batch_size: Callable[[int], int] | None = None
    """``batch_size(consumed samples)``: the global batch of the next iteration under a rampup
    (:class:`hybrid.batch_rampup.BatchRampup`); None: always ``global_batch_size``."""
    per_token_loss: bool = False
    """``--calculate-per-token-loss``: every unmasked token of the global batch weighs the same
    (:func:`train_step`)."""
    final_evaluations: int = 0
    """Evaluations the job runs after the loop (``hybrid.pretrain``: valid and test), counted in
    the ETA."""

    def evaluations_left(self, iteration: int) -> int:
        """Evaluations still to run after iteration ``iteration`` has been logged: the loop's
        (every ``eval_interval`` iterations from this one on, none at the last) and the final
        ones; 0 without ``eval_iters``."""
        if not self.eval_iters:
            return 0
        every = self.eval_interval
        loop = (self.train_iters - 1) // every - (iteration - 1) // every if every else 0
        return max(0, loop) + self.final_evaluations


EvalBatches = Callable[[str, int], "Iterator[torch.Tensor] | None"]
"""``eval_batches(split, consumed)``: an iterator over the ``"valid"`` or ``"test"`` split from
its sample ``consumed`` on, None if the split is empty."""

AfterIteration = Callable[[TrainState], bool]
"""``after_iteration(state)``, called on every rank after each iteration (after logging and
evaluation): the job saves a checkpoint when due there; True (on every rank alike) stops
training after this iteration (SIGTERM, time limit)."""


@dataclass
class Trainer:
    """What the loop needs, in one object, so its methods take only what changes per call.

    Attributes:
        engine: the ZeRO engine (``engine.model`` is the parallel model).
        grid: the process grid.
        settings: counts of the loop (in optimizer steps).
        schedule: ``lr, weight_decay = schedule(state.scheduler_samples)``
            (:class:`hybrid.schedule.ParamSchedule`): iteration ``i`` trains at the schedule
            after ``i - 1`` successful steps, as Megatron-LM's.
        writer: the metrics path (log line, JSONL, wandb).
        eval_batches: iterators over the evaluation splits.
        after_iteration: the job's hook after each iteration (:data:`AfterIteration`; None:
            nothing to do, train to the end).
        progress: a tqdm-like bar with ``update(n)``, or None.
        state: the progress counters (restored on resume).
        stop_now: the world's answer whether the job must stop now (SIGTERM, time limit; one
            collective), asked after each evaluation micro-batch; None: never asked.
    """

    engine: ZeroEngine
    grid: ProcessGrid
    settings: LoopSettings
    schedule: Callable[[int], tuple[float, float | None]]
    writer: MetricsWriter
    eval_batches: EvalBatches = lambda split, consumed: None
    after_iteration: AfterIteration | None = None
    progress: Any = None
    state: TrainState = field(default_factory=TrainState)
    stop_now: Callable[[], bool] | None = None
    profiler: Any = None
    """``--profile``: a :class:`hybrid.torch_profile.IterationProfiler` told where each iteration
    begins and ends (None: no trace)."""
    last_decoupled_lr: float | None = None
    """The embedding and output layer's learning rate of the last iteration (None: ``lr``)."""
    eval_s: float | None = None
    """Seconds the last evaluation in the loop took (the ETA's time per evaluation); None
    before the first."""

    def train(self, train_batches: Iterator[torch.Tensor]) -> TrainState:
        """Run until ``settings.train_iters`` steps; returns the final :class:`TrainState`.

        After every iteration (after logging and evaluation) ``after_iteration`` runs; when it
        says stop (SIGTERM, time limit) training stops there.

        Raises:
            TooManyNaNIterations: ``max_nan_iterations`` consecutive NaN/inf losses.
        """
        self.engine.train()
        s, state = self.settings, self.state
        window = _LogWindow()
        while state.iteration < s.train_iters:
            if self.profiler is not None:
                self.profiler.begin(state.iteration + 1)
            lr, weight_decay = self.schedule(state.scheduler_samples)
            gbs = s.batch_size(state.consumed_samples) if s.batch_size else s.global_batch_size
            batches = [next(train_batches)
                       for _ in range(s.grad_accum_steps * gbs // s.global_batch_size)]
            decoupled = getattr(self.schedule, "decoupled_lr", lambda n: None)(
                state.scheduler_samples)
            last = train_step(self.engine, batches, lr, self.grid, weight_decay, decoupled,
                              s.per_token_loss)
            self.last_decoupled_lr = decoupled
            too_many_nan = self._count(last, window, gbs)
            timer = getattr(self.engine, "timer", NULL_TIMER)
            if timer.enabled:
                timer.end_step()
            if self.progress is not None:
                self.progress.update(1)
            done = state.iteration == s.train_iters
            if state.iteration % s.log_interval == 0 or done or too_many_nan:
                self._log(window, lr, last, timer)
                window = _LogWindow()
            if too_many_nan:  # after logging the window that holds them
                raise TooManyNaNIterations(
                    f"{state.consecutive_nan} consecutive iterations had a NaN/inf loss (last "
                    f"at iteration {state.iteration}); lower --lr, check --clip-grad or check "
                    "the data")
            paused = time.perf_counter()  # evaluation and checkpoints are not training time
            if (s.eval_iters and s.eval_interval and state.iteration % s.eval_interval == 0
                    and not done):
                self.evaluate("valid")
                self.eval_s = time.perf_counter() - paused
            stop = self.after_iteration is not None and self.after_iteration(state)
            if self.profiler is not None:  # a profiled step spans the whole iteration
                self.profiler.end_iteration(state.iteration)
            window.t0 += time.perf_counter() - paused
            if stop:
                break
        return state

    def _count(self, last: StepResult, window: _LogWindow, global_batch: int) -> bool:
        """Advance the counters of the run and of the log window by one iteration of
        ``global_batch`` samples; True when ``max_nan_iterations`` consecutive losses were
        NaN/inf."""
        state = self.state
        state.iteration += 1
        state.consumed_samples += global_batch
        window.samples += global_batch
        window.last_batch = global_batch
        too_many_nan = False
        if last.nan_loss:
            state.nan_iterations += 1
            window.nan += 1
            state.consecutive_nan += 1
            too_many_nan = state.consecutive_nan >= self.settings.max_nan_iterations
        else:
            state.consecutive_nan = 0
            (window.skipped_losses if last.skipped else window.losses).append(last.loss)
        if last.skipped:
            state.skipped_iterations += 1
            window.skipped += 1
        else:  # the schedule advances after an update only, as Megatron-LM's
            state.successful_steps += 1
            state.scheduler_samples += global_batch
        window.steps += 1
        return too_many_nan

    def _log(self, window: _LogWindow, lr: float, last: StepResult, timer) -> None:
        """Write the record of the log window that ends with this iteration."""
        s, state, grid = self.settings, self.state, self.grid
        elapsed = (time.perf_counter() - window.t0) / window.steps
        share = window.samples / (window.steps * s.global_batch_size)  # < 1 in a rampup
        tflops = s.flops_per_step * share / elapsed / grid.world_size / 1e12
        record = dict(
            iteration=state.iteration, consumed_samples=state.consumed_samples,
            lm_loss=window.mean_loss(),
            lr=lr, **({} if self.last_decoupled_lr is None
                      else {"decoupled_lr": self.last_decoupled_lr}),
            global_batch_size=window.last_batch, grad_norm=last.grad_norm,
            loss_scale=last.loss_scale, skipped_iterations=window.skipped,
            nan_iterations=window.nan, elapsed_ms=1000 * elapsed,
            **self._eta(elapsed),
            tokens_per_sec=s.tokens_per_step * share / elapsed, tflops_per_device=tflops,
            mfu=tflops / s.peak_tflops if s.peak_tflops else None,
            **interval_memory(grid.device),
        )
        if timer.enabled:  # --profile-phases: ms per step of each phase in this window
            record.update({f"phase_{k}_ms": v for k, v in timer.per_step_ms().items()})
            timer.reset()
        self.writer.train(record, s.train_iters)
        state.history.append(record)

    def _eta(self, per_iteration: float) -> dict:
        """``eta_s``: the remaining iterations at the log window's pace (seconds per iteration)
        plus the remaining evaluations at the last one's time once one has run; until then
        ``eta_evaluations`` counts the evaluations it leaves out."""
        s, done = self.settings, self.state.iteration
        evals = s.evaluations_left(done)
        eta = (s.train_iters - done) * per_iteration
        if self.eval_s is None:
            return dict(eta_s=eta, eta_evaluations=evals) if evals else dict(eta_s=eta)
        return dict(eta_s=eta + evals * self.eval_s)

    def evaluate(self, split: str) -> float | None:
        """Evaluate ``--eval-iters`` global batches of ``split`` ("valid" or "test") and log one
        record; None if the split is empty or a stop (``stop_now``) ended the evaluation, which
        is then dropped. Validation moves forward through its split from one evaluation to the
        next (``state.consumed_valid_samples``, a dropped one included, so that a resumed run
        validates on the samples of an uninterrupted one), as in Megatron-LM."""
        s, state = self.settings, self.state
        start = state.consumed_valid_samples if split == "valid" else 0
        batches = self.eval_batches(split, start)
        if batches is None:
            return None
        loss = evaluate(self.engine, batches, s.eval_iters * s.grad_accum_steps, self.grid,
                        self.stop_now)
        if split == "valid":
            state.consumed_valid_samples += s.eval_iters * s.global_batch_size
        if loss is None:
            return None
        record = dict(split=split, iteration=state.iteration,
                      consumed_samples=state.consumed_samples, lm_loss=loss)
        self.writer.eval(record)
        self.state.history.append(record)
        return loss
