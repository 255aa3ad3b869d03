"""The training loop: micro-batch accumulation, the optimizer step, evaluation and metrics.

A :class:`Trainer` carries what every step needs (engine, grid, loop settings, LR schedule,
metrics writer, the job's ``after_iteration`` hook). ``train_step`` runs one optimizer step over
``grad_accum_steps`` micro-batches; :meth:`Trainer.train` repeats it with the LR schedule, logs
every ``log_interval`` steps, evaluates on the validation split every ``eval_interval`` steps,
and stops with a clear error after too many consecutive NaN/inf losses. Losses are the
data-parallel mean (identical on every rank).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybrid.metrics import MetricsWriter, interval_memory
from hybrid.zero.grad_norm import host_values
from hybrid.zero.profile import NULL_TIMER

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
    """Steps that updated the weights: the LR schedule's index."""
    skipped_iterations: int = 0
    """Steps skipped for fp16 overflow or a NaN/inf loss, since the start of training; the log
    records count them per log interval, as Megatron-LM does."""
    nan_iterations: int = 0
    """Steps whose loss was NaN/inf, since the start of training (per log interval in the
    records)."""
    consecutive_nan: int = 0
    history: list = field(default_factory=list)

    COUNTERS = ("iteration", "consumed_samples", "successful_steps", "skipped_iterations",
                "nan_iterations")

    def counters(self) -> dict:
        """The counters a checkpoint stores (JSON-able)."""
        return {k: getattr(self, k) for k in self.COUNTERS}

    def restore(self, counters: dict) -> None:
        for k in self.COUNTERS:
            setattr(self, k, int(counters[k]))


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    nan_loss: bool


def _dp_mean(values: torch.Tensor, group, dp: int) -> torch.Tensor:
    if dp > 1:
        dist.all_reduce(values, group=group)
    return values / dp


def train_step(engine: ZeroEngine, micro_batches: list[torch.Tensor], lr: float,
               grid: ProcessGrid) -> StepResult:
    """One optimizer step over this rank's micro-batches ``[b, s+1]`` (int64 token ids).

    The loss of each micro-batch (mean over its tokens) is divided by the number of
    micro-batches before backward, so the gradient is that of the mean over the global batch.
    A NaN/inf data-parallel mean loss discards the gradients instead of stepping.
    """
    n = len(micro_batches)
    losses = torch.zeros(n, dtype=torch.float64, device=grid.device)  # no host sync per micro-batch
    for i, tokens in enumerate(micro_batches):
        tokens = tokens.to(grid.device, non_blocking=True)
        with getattr(engine, "timer", NULL_TIMER).phase("forward"):
            loss = engine.model(tokens[:, :-1], tokens[:, 1:]).mean()
        engine.backward(loss / n, is_last_micro_batch=i == n - 1)
        losses[i] = loss.detach()
    mean = host_values(_dp_mean(losses.mean().reshape(1), grid.dp_group, grid.dp_size))[0]
    if not math.isfinite(mean):
        engine.zero_grad()
        return StepResult(mean, float("nan"), engine.loss_scale, True, True)
    info = engine.step(lr)
    return StepResult(mean, info.grad_norm, info.loss_scale, info.skipped, False)


@torch.no_grad()
def evaluate(engine: ZeroEngine, batches: Iterator[torch.Tensor], num_micro_batches: int,
             grid: ProcessGrid) -> float:
    """Mean loss over ``num_micro_batches`` micro-batches of this rank, averaged over dp."""
    engine.eval()
    total = torch.zeros(1, dtype=torch.float64)
    count = 0
    for _ in range(num_micro_batches):
        try:
            tokens = next(batches).to(grid.device)
        except StopIteration:
            break
        total += engine.model(tokens[:, :-1], tokens[:, 1:]).mean().double().cpu()
        count += 1
    engine.train()
    if count == 0:
        return float("nan")
    return _dp_mean((total / count).to(grid.device), grid.dp_group, grid.dp_size).item()


@dataclass
class _LogWindow:
    """The iterations since the last log record, as Megatron-LM's log line counts them."""

    # time.perf_counter is looked up per call: the tests patch the module's time
    t0: float = field(default_factory=lambda: time.perf_counter())
    steps: int = 0
    skipped: int = 0
    nan: int = 0
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
    eval_interval: int
    eval_iters: int
    max_nan_iterations: int
    flops_per_step: float
    """Model FLOPs of one optimizer step (2205.05198 Eq. 7), for TFLOP/s per device."""
    peak_tflops: float | None
    """Device peak for MFU, None when unknown (CPU)."""


EvalBatches = Callable[[str], "Iterator[torch.Tensor] | None"]
"""``eval_batches(split)``: a fresh iterator over the ``"valid"`` or ``"test"`` split, None if
empty."""

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
        schedule: ``lr = schedule(successful_steps)``.
        writer: the metrics path (log line, JSONL, wandb).
        eval_batches: iterators over the evaluation splits.
        after_iteration: the job's hook after each iteration (:data:`AfterIteration`; None:
            nothing to do, train to the end).
        progress: a tqdm-like bar with ``update(n)``, or None.
        state: the progress counters (restored on resume).
    """

    engine: ZeroEngine
    grid: ProcessGrid
    settings: LoopSettings
    schedule: Callable[[int], float]
    writer: MetricsWriter
    eval_batches: EvalBatches = lambda split: None
    after_iteration: AfterIteration | None = None
    progress: Any = None
    state: TrainState = field(default_factory=TrainState)

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
            lr = self.schedule(state.successful_steps)
            batches = [next(train_batches) for _ in range(s.grad_accum_steps)]
            last = train_step(self.engine, batches, lr, self.grid)
            too_many_nan = self._count(last, window)
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
            if s.eval_iters and state.iteration % s.eval_interval == 0 and not done:
                self.evaluate("valid")
            stop = self.after_iteration is not None and self.after_iteration(state)
            window.t0 += time.perf_counter() - paused
            if stop:
                break
        return state

    def _count(self, last: StepResult, window: _LogWindow) -> bool:
        """Advance the counters of the run and of the log window by one iteration; True when
        ``max_nan_iterations`` consecutive losses were NaN/inf."""
        state = self.state
        state.iteration += 1
        state.consumed_samples += self.settings.global_batch_size
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
        else:
            state.successful_steps += 1
        window.steps += 1
        return too_many_nan

    def _log(self, window: _LogWindow, lr: float, last: StepResult, timer) -> None:
        """Write the record of the log window that ends with this iteration."""
        s, state, grid = self.settings, self.state, self.grid
        elapsed = (time.perf_counter() - window.t0) / window.steps
        tflops = s.flops_per_step / elapsed / grid.world_size / 1e12
        record = dict(
            iteration=state.iteration, consumed_samples=state.consumed_samples,
            lm_loss=window.mean_loss(),
            lr=lr, global_batch_size=s.global_batch_size, grad_norm=last.grad_norm,
            loss_scale=last.loss_scale, skipped_iterations=window.skipped,
            nan_iterations=window.nan, elapsed_ms=1000 * elapsed,
            tokens_per_sec=s.tokens_per_step / elapsed, tflops_per_device=tflops,
            mfu=tflops / s.peak_tflops if s.peak_tflops else None,
            **interval_memory(grid.device),
        )
        if timer.enabled:  # --profile-phases: ms per step of each phase in this window
            record.update({f"phase_{k}_ms": v for k, v in timer.per_step_ms().items()})
            timer.reset()
        self.writer.train(record, s.train_iters)
        state.history.append(record)

    def evaluate(self, split: str) -> float | None:
        """Evaluate on ``split`` ("valid" or "test") and log one record; None if the split is
        empty."""
        batches = self.eval_batches(split)
        if batches is None:
            return None
        s, state = self.settings, self.state
        loss = evaluate(self.engine, batches, s.eval_iters * s.grad_accum_steps, self.grid)
        record = dict(split=split, iteration=state.iteration,
                      consumed_samples=state.consumed_samples, lm_loss=loss)
        self.writer.eval(record)
        self.state.history.append(record)
        return loss
