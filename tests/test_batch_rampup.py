"""Batch-size rampup (issue 26 item 2): ``--rampup-batch-size START INCR SAMPLES`` gives
Megatron-LM's batch sizes, iteration count and learning rates, is exact on another grid, and
resumes mid-rampup bit for bit (dropout on)."""

from __future__ import annotations

import pytest
import torch

from hybrid.batch_rampup import BatchRampup
from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.job.schedule_setup import build_schedule
from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs
from tests.test_schedule import MegatronScheduler, RecordingEngine, run_loop


class MegatronRampup:
    """Megatron-LM's ``RampupBatchsizeNumMicroBatchesCalculator.update`` and the rampup branch of
    ``update_train_iters`` (``megatron/core/num_microbatches_calculator.py`` and
    ``megatron/training/training.py`` before the rampup was deprecated), their arithmetic."""

    def __init__(self, global_batch_size, start_global_batch_size, batch_size_increment,
                 ramup_samples):
        self.global_batch_size, self.start = global_batch_size, start_global_batch_size
        self.incr, self.ramup_samples = batch_size_increment, ramup_samples
        num_increments = (global_batch_size - start_global_batch_size) // batch_size_increment
        self.rampup_samples_per_increment = self.ramup_samples / num_increments

    def current(self, consumed_samples):
        if consumed_samples > self.ramup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start + steps * self.incr

    def train_iters(self, train_samples):
        iterations = consumed_samples = 0
        while consumed_samples <= self.ramup_samples and consumed_samples <= train_samples:
            consumed_samples += self.current(consumed_samples)
            iterations += 1
        if train_samples > consumed_samples:
            iterations += (train_samples - consumed_samples) // self.global_batch_size
        return iterations


@pytest.mark.parametrize("gbs,start,incr,samples,train", [
    (12, 4, 4, 16, 40), (32, 8, 8, 100, 500), (48, 16, 16, 7, 300), (96, 32, 32, 1000, 700)])
def test_batch_sizes_and_iterations_equal_megatrons(gbs, start, incr, samples, train):
    ours, theirs = BatchRampup(start, incr, samples, gbs), MegatronRampup(gbs, start, incr,
                                                                         samples)
    assert ours.iterations(train) == theirs.train_iters(train)
    assert [ours.batch_size(c) for c in range(0, 2 * samples + 50)] == [
        theirs.current(c) for c in range(0, 2 * samples + 50)]


ARGV = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2",
        "--global-batch-size", "12", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-samples", "6"]


class CountingEngine(RecordingEngine):
    """Also records the micro-batches of each step."""

    def __init__(self):
        super().__init__()
        self.micro, self.sizes = 0, []

    def backward(self, loss, is_last_micro_batch):
        self.micro += 1

    def step(self, lr, weight_decay=None):
        self.sizes.append(self.micro)
        self.micro = 0
        return super().step(lr, weight_decay)


def test_the_loop_steps_megatrons_batches_and_rates():
    job = validate(parse_config(ARGV + ["--train-samples", "70", "--rampup-batch-size", "4", "2",
                                        "20"]), world_size=1)
    engine = CountingEngine()
    run_loop(build_schedule(job.schedule), job.cfg.training.train_iters, engine,
             batch_size=job.rampup.batch_size, global_batch_size=12, grad_accum_steps=6)
    # Megatron-LM: the scheduler was built with lengths in samples and steps by the current batch
    mega = MegatronRampup(12, 4, 2, 20)
    m = MegatronScheduler(0.0, 1e-3, 1e-4, 6, 70, "cosine", 0.01, 0.01, 70, "constant")
    expected_sizes, expected, consumed = [], [], 0
    for _ in range(mega.train_iters(70)):
        b = mega.current(consumed)
        expected_sizes.append(b // 2)  # micro-batches of 2 samples on one rank
        expected.append((m.get_lr(), m.get_wd()))
        m.step(b)
        consumed += b
    assert job.cfg.training.train_iters == len(expected_sizes)
    assert engine.sizes == expected_sizes and engine.seen == expected


@pytest.mark.parametrize("extra,message", [
    (["--train-iters", "5", "--rampup-batch-size", "4", "4", "16"],
     "--rampup-batch-size, --lr-warmup-samples need sample-based training"),
    (["--train-samples", "40", "--rampup-batch-size", "3", "3", "16"],
     "global batch 3 of the rampup is not divisible by --micro-batch-size 2"),
    (["--train-samples", "40", "--rampup-batch-size", "4", "5", "16"],
     "the difference a multiple of the increment 5"),
    (["--train-samples", "40", "--rampup-batch-size", "4", "4", "0"],
     "need a positive start, increment and number of samples"),
])
def test_bad_rampups_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_config(ARGV + extra), world_size=1)


MODEL = ["--mock-data", "--vocab-size", "500", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--lr", "3e-3",
         "--min-lr", "3e-4", "--lr-warmup-samples", "8", "--lr-decay-samples", "40",
         "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-iters", "0", "--seed", "7"]


@pytest.mark.timeout(400)
def test_rampup_is_exact_on_another_grid_and_resumes_mid_rampup(tmp_path):
    ck = str(tmp_path / "ck")
    drop = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    off = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    dp2, tp2 = ["--tensor-model-parallel-size", "1"], ["--tensor-model-parallel-size", "2"]
    straight, first, resumed, dp_off, tp_off = spawn_world(2, run_configs, [
        MODEL + drop + dp2 + ["--train-samples", "40"],
        MODEL + drop + dp2 + ["--train-samples", "15", "--save", ck],  # 3 iterations: 4, 4, 8
        MODEL + drop + dp2 + ["--train-samples", "40", "--load", ck],
        MODEL + off + dp2 + ["--train-samples", "40"],
        MODEL + off + tp2 + ["--train-samples", "40"],
    ], timeout_s=120, join_timeout_s=600)[0]

    def train(h):
        return {r["iteration"]: r for r in h if "split" not in r}
    s, f, r = train(straight), train(first), train(resumed)
    assert [(i, x["global_batch_size"], x["consumed_samples"]) for i, x in s.items()] == [
        (1, 4, 4), (2, 4, 8), (3, 8, 16), (4, 12, 28), (5, 12, 40)]
    assert sorted(f) == [1, 2, 3] and sorted(r) == [4, 5]
    for i in s:  # bit for bit, dropout on, across the resume in the rampup
        assert (f | r)[i]["lm_loss"] == s[i]["lm_loss"] and (f | r)[i]["lr"] == s[i]["lr"], i
    d, t = train(dp_off), train(tp_off)  # tp1 x dp2 vs tp2 x dp1, fp32 reduction orders differ
    torch.testing.assert_close([x["lm_loss"] for x in t.values()],
                               [x["lm_loss"] for x in d.values()], rtol=1e-5, atol=0)
