"""Synthetic GPT samples (``--mock-data``): Megatron-LM's mock dataset, learnable and seeded.

Megatron-LM's ``MockGPTLowLevelDataset`` is 100,000 documents whose lengths are drawn once with
``numpy.random.default_rng(0).integers(1, 4096, 100000)``; document ``i`` of length ``L`` is the
token ids ``1, 2, ..., L - 1`` (modulo the vocabulary) followed by the end-of-document id. Its
``MockGPTDataset`` is the ordinary ``GPTDataset`` over those documents: split by ``--split``,
shuffled and packed into ``seq_length + 1``-token samples with ``--seed``
(:func:`data.gpt_dataset.build_sample_indices`). So the same seed gives the same samples on
every rank and grid, and the next token is predictable (one more than the last, except after a
document's end): the loss falls, which is Megatron-LM's smoke test of a new setup.

Nothing is written to disk: the indices are built in memory (about 0.1 s for the default split).
"""

from __future__ import annotations

import numpy as np

from data.gpt_dataset import GPTDataset, build_sample_indices
from data.split import parse_split, split_ranges

MOCK_DOCUMENTS = 100_000
"""Documents of Megatron-LM's mock low-level dataset (its ``size``)."""
MOCK_MAX_LENGTH = 4096
"""Lengths are drawn from ``[1, MOCK_MAX_LENGTH)`` (its ``max_sequence_length``)."""
MOCK_LENGTH_SEED = 0
"""The fixed seed of the length draw (its ``seed``); ``--seed`` shuffles the samples."""


class MockLowLevelDataset:
    """The mock documents, with the reading interface of
    :class:`data.indexed_dataset.IndexedDataset` (``sizes``, ``get``).

    Args:
        vocab_size: token ids are taken modulo this (tokens).
        eod: the end-of-document id that ends every document.
    """

    def __init__(self, vocab_size: int, eod: int):
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"bad mock dataset: vocab_size={vocab_size}, eod={eod}")
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=MOCK_LENGTH_SEED)
        self.sizes = rng.integers(low=1, high=MOCK_MAX_LENGTH, size=MOCK_DOCUMENTS,
                                  dtype=np.int32)

    def __len__(self) -> int:
        return MOCK_DOCUMENTS

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i`` (``int64``; to its end when
        ``length`` is None)."""
        size = int(self.sizes[i])
        end = size if length is None else offset + length
        ids = (np.arange(offset, end, dtype=np.int64) + 1) % self.vocab_size
        if end == size:  # the last token of a document is its end-of-document id
            ids[-1] = self.eod
        return ids


class MockGPTDataset(GPTDataset):
    """One split of the mock documents as shuffled ``seq_length + 1``-token samples
    (``ds[i] = {"tokens": LongTensor[seq_length + 1]}``), Megatron-LM's ``MockGPTDataset``: a
    :class:`data.gpt_dataset.GPTDataset` whose documents are :class:`MockLowLevelDataset`'s.

    Args:
        split: the ``--split`` string; ``split_index``: 0 train, 1 valid, 2 test.
        num_samples: samples needed (``len(ds)`` is every sample of the epochs built).
        seed: the shuffling seed (``--seed``).

    Raises:
        ValueError: an empty split, or see :func:`data.gpt_dataset.build_sample_indices`.
    """

    def __init__(self, low: MockLowLevelDataset, split: str, split_index: int, num_samples: int,
                 seq_length: int, seed: int):  # no super().__init__: no files, no index cache
        d0, d1 = split_ranges(parse_split(split), len(low))[split_index]
        if d1 <= d0:
            raise ValueError(f"--split {split} gives mock split {split_index} no document")
        self.indexed, self.seq_length = low, seq_length
        arrays = build_sample_indices(low.sizes[d0:d1], d0, num_samples, seq_length, seed)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (arrays["doc"], arrays["sample"],
                                                           arrays["shuffle"])
