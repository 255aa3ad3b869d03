"""The training loop's bookkeeping, with a fake engine and a fake clock (no processes)."""

from types import SimpleNamespace

import torch

import hybrid.training as training
from hybrid.metrics import MetricsWriter
from hybrid.schedule import LRSchedule, ParamSchedule, WeightDecaySchedule
from hybrid.training import LoopSettings, Trainer


class FakeEngine:
    """Each micro-batch costs 1 s of the fake clock; evaluation costs 100 s."""

    def __init__(self, clock, losses):
        self.clock, self.losses, self.loss_scale, self.evaluating = clock, iter(losses), 1.0, False
        self.steps, self.zeroed, self.overflow = 0, 0, set()

    def model(self, x, y):
        self.clock[0] += 100.0 if self.evaluating else 1.0
        return torch.full(y.shape, 3.0 if self.evaluating else next(self.losses))

    def backward(self, loss, is_last_micro_batch):
        pass

    def step(self, lr, weight_decay=None):
        self.steps += 1  # an fp16 overflow at the step numbers in self.overflow
        skipped = self.steps in self.overflow
        return SimpleNamespace(skipped=skipped, grad_norm=float("inf") if skipped else 1.0,
                               loss_scale=1.0)

    def zero_grad(self):
        self.zeroed += 1

    def train(self):
        self.evaluating = False

    def eval(self):
        self.evaluating = True


def run(losses, **kw):
    clock = [0.0]
    training.time = SimpleNamespace(perf_counter=lambda: clock[0])
    engine = FakeEngine(clock, losses)
    engine.overflow = kw.get("overflow", set())
    grid = SimpleNamespace(device=torch.device("cpu"), dp_group=None, dp_size=1, world_size=1)
    settings = LoopSettings(train_iters=kw.get("iters", 6), grad_accum_steps=1, global_batch_size=2,
                            tokens_per_step=8, log_interval=kw.get("log", 3),
                            eval_interval=kw.get("eval", 2), eval_iters=1,
                            max_nan_iterations=kw.get("max_nan", 10), flops_per_step=1e12,
                            peak_tflops=None)
    batches = iter([torch.zeros(2, 5, dtype=torch.long)] * 100)
    writer = MetricsWriter(0, None, {}, print_fn=lambda *_: None)
    schedule = ParamSchedule(LRSchedule(1.0, 0.1, 1, 12, "cosine"), WeightDecaySchedule(0, 0, 12))
    trainer = Trainer(engine, grid, settings, schedule, writer,
                      kw.get("eval_batches",
                             lambda split, start: iter([torch.zeros(2, 5, dtype=torch.long)])),
                      kw.get("after"))
    state = trainer.state
    state.history = kw.get("history", state.history)
    try:
        trainer.train(batches)
    finally:
        import time

        training.time = time
    return state, engine


def test_evaluation_time_is_not_counted_as_iteration_time():
    # regression: an evaluation inside a log window once halved the logged ms per iteration
    state, _ = run([5.0] * 6, log=3, eval=2)
    records = [r for r in state.history if "split" not in r]
    assert [r["elapsed_ms"] for r in records] == [1000.0, 1000.0]
    assert [r["tokens_per_sec"] for r in records] == [8.0, 8.0]


def test_after_iteration_follows_each_logged_iteration_and_can_stop_the_loop():
    seen = []

    def after(state):
        seen.append((state.iteration, len(state.history)))
        return state.iteration == 4  # as SIGTERM would
    state, engine = run([5.0] * 6, log=2, eval=100, after=after)
    assert seen == [(1, 0), (2, 1), (3, 1), (4, 2)]
    assert (state.iteration, engine.steps) == (4, 4)


def test_nan_loss_skips_the_step_and_does_not_advance_the_schedule():
    nan = float("nan")
    state, engine = run([5.0, nan, 4.0, 3.0, 2.0, 1.0], log=1, eval=100)
    assert engine.zeroed == 1 and engine.steps == 5
    assert (state.nan_iterations, state.skipped_iterations, state.successful_steps) == (1, 1, 5)
    lrs = [r["lr"] for r in state.history]
    assert lrs[1] == lrs[2]  # the skipped iteration did not move the LR schedule


def test_log_records_count_skipped_and_nan_iterations_per_log_interval():
    # Megatron-LM's "number of skipped iterations" counts the log interval, not the whole run
    nan = float("nan")
    state, _ = run([5.0, nan, 4.0, nan, nan, 2.0], log=3, eval=100)
    records = [r for r in state.history if "split" not in r]
    assert [(r["skipped_iterations"], r["nan_iterations"]) for r in records] == [(1, 1), (2, 2)]
    assert (state.skipped_iterations, state.nan_iterations) == (3, 3)


def test_the_logged_loss_averages_the_steps_that_updated_the_weights():
    # as Megatron-LM's training_log: fp16-skipped steps are left out of the window's mean loss,
    # unless every step of the window was skipped (then their forward losses are all there is)
    state, _ = run([5.0, 4.0, 3.0, 3.0, 1.0, 2.0], log=3, eval=100, overflow={1, 2, 4, 5, 6})
    records = [r for r in state.history if "split" not in r]
    assert [(r["lm_loss"], r["skipped_iterations"]) for r in records] == [(3.0, 2), (2.0, 3)]


def test_too_many_nan_iterations_stop_with_a_clear_error_after_logging_them():
    import pytest

    nan = float("nan")
    with pytest.raises(training.TooManyNaNIterations,
                       match="3 consecutive iterations had a NaN/inf loss"):
        run([1.0, nan, nan, nan, 1.0, 1.0], max_nan=3, eval=100, log=10, history=(history := []))
    assert [(r["iteration"], r["nan_iterations"]) for r in history] == [(4, 3)]


def test_validation_moves_forward_through_its_split():
    # as Megatron-LM's consumed_valid_samples: each evaluation starts where the last one stopped
    starts = []

    def eval_batches(split, start):
        starts.append((split, start))
        return iter([torch.zeros(2, 5, dtype=torch.long)])
    state, _ = run([5.0] * 6, log=3, eval=2, eval_batches=eval_batches)
    assert starts == [("valid", 0), ("valid", 2)]  # at 2 and 4; eval_iters 1 x global batch 2
    assert state.consumed_valid_samples == 4
    assert state.counters()["consumed_valid_samples"] == 4  # stored in checkpoints
