"""Synthetic GPT samples (``--mock-data``): random tokens, a pure function of (seed, index)."""

from __future__ import annotations

import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` uniform random token ids in
    ``[0, vocab_size)``.

    Sample ``i`` is drawn from a generator seeded with ``seed * 1_000_003 + i``, so every rank
    and every grid sees the same sample ``i`` without any shared state.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        if num_samples < 0 or seq_length < 1 or vocab_size < 2:
            raise ValueError(f"bad mock dataset: num_samples={num_samples}, "
                             f"seq_length={seq_length}, vocab_size={vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = (num_samples, seq_length,
                                                                         vocab_size, seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"tokens": torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)}
