"""Vocabulary padding for the vocab-parallel embedding and head (pure arithmetic, no torch)."""

from __future__ import annotations


def pad_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by * tp`` (rows of the embedding).

    Megatron-LM (1909.08053) §5.1: each TP rank's vocabulary slice should be a multiple of 128,
    so 50,257 becomes 51,200 for 8-way TP. Raises ValueError on a non-positive argument.
    """
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("divisible_by", divisible_by)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
