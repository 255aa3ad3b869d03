"""Global-batch-size rampup, as Megatron-LM's ``--rampup-batch-size START INCR SAMPLES``.

The global batch starts at ``START`` and grows by ``INCR`` every ``SAMPLES / n`` consumed samples
(``n = (global batch - START) / INCR`` increments) until ``SAMPLES`` samples are consumed, then
stays at ``--global-batch-size`` (Megatron-LM's ``RampupBatchsizeNumMicroBatchesCalculator``;
the rampup of GPT-3, arXiv:2005.14165 Appendix B). Each batch size is a whole number of
micro-batches on every data-parallel rank, so a step at batch ``B`` accumulates ``B / (micro
batch x dp)`` micro-batches per rank and the sample order is that of a fixed batch: the run is
exact on every grid and resumes mid-rampup from its consumed samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    """The global batch size after ``consumed`` samples (:meth:`batch_size`).

    Raises:
        ValueError: a non-positive start, increment or samples, a start above the
            global batch, or a difference not divisible by the increment (Megatron-LM's
            assertions).
    """

    start: int
    increment: int
    samples: int
    global_batch_size: int

    def __post_init__(self):
        if self.start <= 0 or self.increment <= 0 or self.samples <= 0:
            # samples 0 would divide by zero (as in Megatron-LM); no rampup is no flag
            raise ValueError(f"--rampup-batch-size {self.start} {self.increment} {self.samples}: "
                             "need a positive start, increment and number of samples (to train "
                             "without a rampup, drop the flag)")
        diff = self.global_batch_size - self.start
        if diff < 0 or diff % self.increment:
            raise ValueError(f"--rampup-batch-size start {self.start} must be at most "
                             f"--global-batch-size {self.global_batch_size}, the difference a "
                             f"multiple of the increment {self.increment}")

    @property
    def sizes(self) -> list[int]:
        """Every global batch size of the run, in order."""
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def batch_size(self, consumed: int) -> int:
        """The global batch of the iteration that starts after ``consumed`` samples."""
        increments = (self.global_batch_size - self.start) // self.increment
        if consumed > self.samples or increments == 0:
            return self.global_batch_size
        per_increment = self.samples / increments
        return self.start + int(consumed / per_increment) * self.increment

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.batch_size(consumed)
        return consumed

    def iterations(self, train_samples: int) -> int:
        """Iterations of a run of ``train_samples`` samples (Megatron-LM's
        ``update_train_iters``): the rampup's iterations, then whole global batches (a last
        partial batch is not trained)."""
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations
