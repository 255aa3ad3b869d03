"""The learning rate and weight decay of every iteration equal Megatron-LM's, iteration- and
sample-based (issue 26 items 1 and 2).

``MegatronScheduler`` below is Megatron-LM's ``OptimizerParamScheduler`` (file
``megatron/core/optimizer_param_scheduler.py``: ``get_lr``, ``get_wd``, ``step``) written out,
built as ``megatron/training/training.py``'s ``get_optimizer_param_scheduler`` builds it (lengths
in samples) and stepped as its ``train_step`` steps it: after each successful update, by the
global batch. Ours runs through the real loop (``Trainer``) with a fake engine that records the
rate and weight decay each iteration trained with; the values must be equal, float for float,
and a run resumed from the loop's counters must continue them exactly.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.job.schedule_setup import build_schedule
from hybrid.metrics import MetricsWriter
from hybrid.training import LoopSettings, Trainer, TrainState


class MegatronScheduler:
    """Megatron-LM's OptimizerParamScheduler, its arithmetic only (source named above)."""

    def __init__(self, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 start_wd, end_wd, wd_incr_steps, wd_incr_style, wsd_decay_steps=None,
                 lr_wsd_decay_style=None):
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style, self.wsd_decay_steps = lr_decay_style, wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.num_steps = 0

    def get_wd(self):
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == 'constant':
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == 'linear':
            coeff = incr_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self):
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (
                (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == 'constant':
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == 'inverse-square-root':
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
            return max(min_lr, lr)
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
                elif self.lr_wsd_decay_style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(wsd_decay_ratio)
        return min_lr + coeff * delta_lr

    def step(self, increment):
        self.num_steps += increment


def megatron_from_args(a: dict, gbs: int) -> MegatronScheduler:
    """``get_optimizer_param_scheduler``'s two branches (``a``: Megatron's args)."""
    if a.get("train_iters"):  # iteration-based
        decay_iters = a.get("lr_decay_iters") or a["train_iters"]
        lr_decay_steps = decay_iters * gbs
        wd_incr_steps = a["train_iters"] * gbs
        wsd = a.get("lr_wsd_decay_iters")
        wsd_decay_steps = None if wsd is None else wsd * gbs
        if a.get("lr_warmup_fraction") is not None:
            lr_warmup_steps = a["lr_warmup_fraction"] * lr_decay_steps
        else:
            lr_warmup_steps = a.get("lr_warmup_iters", 0) * gbs
    else:  # sample-based
        lr_decay_steps = a.get("lr_decay_samples") or a["train_samples"]
        wd_incr_steps = a["train_samples"]
        wsd_decay_steps = a.get("lr_wsd_decay_samples")
        if a.get("lr_warmup_fraction") is not None:
            lr_warmup_steps = a["lr_warmup_fraction"] * lr_decay_steps
        else:
            lr_warmup_steps = a.get("lr_warmup_samples", 0)
    wd = a.get("weight_decay", 0.01)
    return MegatronScheduler(
        a.get("lr_warmup_init", 0.0), a["lr"], a.get("min_lr", 0.0), lr_warmup_steps,
        lr_decay_steps, a.get("lr_decay_style", "linear"), a.get("start_weight_decay", wd),
        a.get("end_weight_decay", wd), wd_incr_steps, a.get("weight_decay_incr_style", "constant"),
        wsd_decay_steps, a.get("lr_wsd_decay_style", "exponential"))


class RecordingEngine:
    """Records the (lr, weight decay) of each step; the steps in ``overflow`` are skipped."""

    def __init__(self, overflow=()):
        self.seen, self.overflow, self.loss_scale = [], set(overflow), 1.0

    def model(self, x, y):
        return torch.full(y.shape, 2.0)

    def backward(self, loss, is_last_micro_batch):
        pass

    def step(self, lr, weight_decay=None):
        self.seen.append((lr, weight_decay))
        skipped = len(self.seen) in self.overflow
        return SimpleNamespace(skipped=skipped, grad_norm=1.0, loss_scale=1.0)

    def train(self):
        pass


GBS = 8
GRID = SimpleNamespace(device=torch.device("cpu"), dp_group=None, dp_size=1, world_size=1)


def run_loop(schedule, iters, engine, state=None, after=None, **settings_kw):
    """Train ``iters`` iterations of the real loop on ``engine`` (``settings_kw`` overrides
    :class:`LoopSettings` fields)."""
    kw = dict(train_iters=iters, grad_accum_steps=1, global_batch_size=GBS, tokens_per_step=GBS,
              log_interval=1000, eval_interval=None, eval_iters=0, max_nan_iterations=10,
              flops_per_step=1.0, peak_tflops=None)
    settings = LoopSettings(**(kw | settings_kw))
    writer = MetricsWriter(0, None, {}, print_fn=lambda *_: None)
    trainer = Trainer(engine, GRID, settings, schedule, writer, after_iteration=after,
                      state=state or TrainState())
    return trainer.train(iter([torch.zeros(1, 3, dtype=torch.long)] * 1000))


def megatron_values(a: dict, overflow=()) -> list[tuple[float, float]]:
    """What Megatron-LM's train loop trains each iteration with (its scheduler is built, so
    stepped by 0, before the first iteration; each successful update steps it by the batch)."""
    m, out = megatron_from_args(a, GBS), []
    for i in range(1, iterations(a) + 1):
        out.append((m.get_lr(), m.get_wd()))
        if i not in overflow:
            m.step(GBS)
    return out


def iterations(a: dict) -> int:
    """``update_train_iters``: sample-based runs train ``train_samples // global batch``."""
    return a.get("train_iters") or a["train_samples"] // GBS


def argv_of(a: dict) -> list[str]:
    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
            "--global-batch-size", str(GBS)]
    for k, v in a.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv


CASES = [
    dict(lr=1e-3, train_iters=40),  # Megatron-LM's defaults: linear, no warmup, init 0
    dict(lr=1e-3, min_lr=1e-4, train_iters=40, lr_warmup_iters=5),
    dict(lr=1e-3, min_lr=1e-4, train_iters=40, lr_warmup_iters=5, lr_warmup_init=2e-4,
         lr_decay_style="cosine", lr_decay_iters=30),
    dict(lr=1e-3, min_lr=1e-5, train_iters=30, lr_warmup_fraction=0.07, lr_decay_style="cosine"),
    dict(lr=1e-3, train_iters=20, lr_warmup_iters=3, lr_decay_style="constant"),
    dict(lr=1e-3, min_lr=1e-5, train_iters=40, lr_warmup_iters=4,
         lr_decay_style="inverse-square-root"),
    dict(lr=1e-3, min_lr=1e-4, train_iters=30, lr_decay_style="inverse-square-root"),
    *[dict(lr=1e-3, min_lr=1e-4, train_iters=40, lr_warmup_iters=4, lr_decay_style="WSD",
           lr_wsd_decay_iters=10, lr_wsd_decay_style=w)
      for w in ("exponential", "linear", "cosine", "minus_sqrt")],
    dict(lr=1e-3, train_iters=40, lr_decay_iters=25, weight_decay_incr_style="linear",
         start_weight_decay=0.0, end_weight_decay=0.1),
    dict(lr=1e-3, train_iters=40, lr_warmup_iters=2, weight_decay_incr_style="cosine",
         start_weight_decay=0.01, end_weight_decay=0.1),
    # sample-based: lengths in samples, not multiples of the global batch 8
    dict(lr=1e-3, min_lr=1e-4, train_samples=301, lr_warmup_samples=21,
         lr_decay_style="cosine"),
    dict(lr=1e-3, train_samples=320, lr_decay_samples=203, lr_warmup_fraction=0.05,
         lr_warmup_init=1e-4),
    dict(lr=1e-3, min_lr=1e-5, train_samples=320, lr_warmup_samples=16, lr_decay_style="WSD",
         lr_wsd_decay_samples=83, lr_wsd_decay_style="minus_sqrt"),
    dict(lr=1e-3, train_samples=250, lr_decay_style="inverse-square-root", lr_warmup_samples=9,
         weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.05),
]


@pytest.mark.parametrize("a", CASES, ids=lambda a: "-".join(f"{v}" for v in a.values()))
def test_every_iteration_trains_at_megatrons_lr_and_weight_decay(a):
    job = validate(parse_config(argv_of(a)), world_size=1)
    engine = RecordingEngine(overflow={3, 4, 11})
    assert job.cfg.training.train_iters == iterations(a)
    run_loop(build_schedule(job.schedule), iterations(a), engine)
    assert engine.seen == megatron_values(a, overflow={3, 4, 11})
    assert engine.seen[0][0] == a.get("lr_warmup_init", 0.0) or not a.get("lr_warmup_iters")


@pytest.mark.parametrize("a", [CASES[2], CASES[7], CASES[11], CASES[14]],
                         ids=["cosine", "wsd", "wd-cos", "samples-wsd"])
def test_a_resumed_run_continues_the_schedule_exactly(a):
    schedule = build_schedule(validate(parse_config(argv_of(a)), world_size=1).schedule)
    first = RecordingEngine(overflow={2})
    state = run_loop(schedule, iterations(a), first, after=lambda s: s.iteration == 13)
    resumed = TrainState()
    resumed.restore(state.counters())
    second = RecordingEngine()
    run_loop(schedule, iterations(a), second, state=resumed)
    assert first.seen + second.seen == megatron_values(a, overflow={2})


@pytest.mark.parametrize("extra,message", [
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "--lr-warmup-fraction 0.1 and --lr-warmup-iters 2: give only one"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-warmup-iters", "10"],
     "--lr-warmup-iters 10: the warmup must be shorter than the decay"),
    (["--lr-warmup-init", "1"], r"--lr-warmup-init \(1.0\) <= --lr"),
    (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "linear"], "needs --start-weight-decay and --end-weight-decay"),
    (["--lr-decay-samples", "40"], "--lr-decay-samples needs sample-based training"),
    (["--train-samples", "80"], "--train-samples 80 is sample-based training: give the "
                                "\\*-samples flags instead of --train-iters"),
    (["--train-samples", "4"], "--train-samples 4 is less than one global batch"),
])
def test_schedule_flags_megatron_refuses_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        a = dict(lr=1e-3) if "--train-samples" in extra[:1] and extra[1] == "4" else dict(
            lr=1e-3, train_iters=10)
        validate(parse_config(argv_of(a) + extra), world_size=1)
