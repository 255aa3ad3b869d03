"""GPT pretraining samples: ``seq_length + 1`` tokens cut from a stream of shuffled documents.

For one split of one indexed dataset (a contiguous range of its documents):

* **document index** ``doc_idx[e * D]``: the split's D sequences repeated for as many epochs
  ``e`` as ``num_samples`` needs, shuffled together (``numpy.random.RandomState(seed)``, frozen
  across numpy versions). When the samples asked of the last epoch are fewer than 80% of an
  epoch, the first ``e - 1`` epochs are shuffled together and the last on its own after them.
* **sample index** ``sample_idx[S + 1, 2]``: ``(position in doc_idx, token offset)`` where
  sample ``j`` starts; sample ``j`` is the tokens from its start up to and *including* the
  start of sample ``j + 1``. Samples run across document boundaries, consecutive samples
  share one token (the last input's label), so the samples in order, each without its last
  token, are exactly the document stream: no gap, no overlap.
  ``S = (e * T - 1) // seq_length`` for ``T`` tokens per epoch.
* **shuffle index** ``shuffle_idx[S]``: a permutation of samples; with a separate last epoch,
  the samples of the first ``e - 1`` epochs are shuffled among themselves and come first, the
  rest after.

This is Megatron-LM's ``GPTDataset`` (the same seed gives the same samples in the same order).

The three arrays are cached as ``.npy`` beside the data (``<data dir>/cache/GPTDataset_indices``,
or ``cache_dir``) under a hash of every setting (:mod:`data.index_cache`) and reused; with
``torch.distributed`` initialised they are built on rank 0 first (:mod:`data.rank0_first`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from data.blended_dataset import (
    MID_LEVEL_SURPLUS,
    BlendedDataset,
    blending_indices,
    normalize,
    parse_data_path,
    sizes_per_dataset,
)
from data.index_cache import array_digest, load_or_build
from data.indexed_dataset import IndexedDataset, idx_path
from data.rank0_first import run_rank0_first
from data.split import SPLIT_NAMES, parse_split, split_ranges

INDEX_FORMAT_VERSION = 2  # bump when the index construction changes, to invalidate caches


def build_sample_indices(
    sizes: np.ndarray, first_sequence: int, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of one split (see the module docstring).

    Args:
        sizes: ``[D]`` tokens of each sequence of the split.
        first_sequence: index of the split's first sequence in the indexed dataset.
        num_samples: samples needed (at least this many are built).
        seq_length: tokens per sample minus one.

    Returns:
        ``{"doc": int32/int64 [e * D], "sample": [S + 1, 2], "shuffle": [S]}``.

    Raises:
        ValueError: ``num_samples < 1``, ``seq_length < 1``, or a split with fewer than 2 tokens.
    """
    if num_samples < 1 or seq_length < 1:
        raise ValueError(f"num_samples ({num_samples}) and seq_length ({seq_length}) must be >= 1")
    sizes = np.asarray(sizes, np.int64)
    tokens = int(sizes.sum())
    if tokens < 2:
        raise ValueError(
            f"a split with {tokens} tokens cannot make a {seq_length + 1}-token sample"
        )
    epochs = -(-(num_samples * seq_length + 1) // tokens)  # smallest e with (e*T - 1)//L >= n
    n_docs = len(sizes)
    total = (epochs * tokens - 1) // seq_length
    full = ((epochs - 1) * tokens - 1) // seq_length if epochs > 1 else 0
    separate = epochs > 1 and num_samples - full < int(0.80 * ((tokens - 1) // seq_length))
    rng = np.random.RandomState(seed)

    def shuffled_epochs(e: int) -> np.ndarray:
        return np.tile(np.arange(n_docs, dtype=np.int64), e)[rng.permutation(e * n_docs)]

    local = (np.concatenate([shuffled_epochs(epochs - 1), shuffled_epochs(1)]) if separate
             else shuffled_epochs(epochs))
    idx_dtype = np.int32 if first_sequence + n_docs < 2**31 else np.int64
    lengths = sizes[local]
    ends = np.cumsum(lengths)
    starts = np.arange(total + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")  # skips empty documents
    offsets = starts - (ends[pos] - lengths[pos])
    pair_dtype = np.int32 if len(local) < 2**31 and int(sizes.max()) < 2**31 else np.int64
    sample = np.stack([pos, offsets], axis=1).astype(pair_dtype)
    shuffle = (np.concatenate([rng.permutation(full), full + rng.permutation(total - full)])
               if separate else rng.permutation(total))
    return {"doc": (local + first_sequence).astype(idx_dtype), "sample": sample, "shuffle": shuffle}


class GPTDataset(torch.utils.data.Dataset):
    """Shuffled ``seq_length + 1``-token samples of one split of one indexed dataset.

    ``ds[i]`` is ``{"tokens": LongTensor[seq_length + 1]}`` (inputs ``tokens[:-1]``, labels
    ``tokens[1:]``). ``len(ds) >= num_samples``: every sample of the epochs that were built.

    Args:
        prefix: indexed dataset prefix.
        document_range: ``[start, end)`` documents of this split.
        num_samples: samples needed.
        seq_length: tokens per sample minus one.
        seed: shuffling seed.
        split_name: for file names and messages.
        cache_dir: index cache directory (default ``<prefix dir>/cache/GPTDataset_indices``).
        description: extra settings to hash into the cache name (the split string, say).

    Raises:
        ValueError: an empty document range, or see :func:`build_sample_indices`.
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | os.PathLike | None = None,
        description: dict | None = None,
    ):
        self.prefix = os.path.abspath(os.fspath(prefix))
        self.indexed = IndexedDataset(self.prefix)
        d0, d1 = document_range
        if d1 <= d0:
            raise ValueError(
                f"{split_name} split of {self.prefix} has no documents (range {document_range})"
            )
        s0, s1 = int(self.indexed.document_indices[d0]), int(self.indexed.document_indices[d1])
        self.seq_length, self.split_name = seq_length, split_name
        self.cache_dir = (
            Path(cache_dir)
            if cache_dir
            else Path(self.prefix).parent / "cache" / "GPTDataset_indices"
        )
        self.description = {
            "class": "GPTDataset",
            "version": INDEX_FORMAT_VERSION,
            "prefix": self.prefix,
            "idx_bytes": idx_path(self.prefix).stat().st_size,
            "sequences": len(self.indexed),
            "tokens": self.indexed.num_tokens,
            # what the indices are computed from, by content: a rewritten .idx with the old
            # size and mtime gets a new cache entry
            "sizes_sha256": array_digest(self.indexed.sizes[s0:s1]),
            "split": split_name,
            "documents": [d0, d1],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            **(description or {}),
        }
        arrays = load_or_build(
            self.cache_dir,
            f"GPTDataset-{split_name}",
            self.description,
            ("doc", "sample", "shuffle"),
            lambda: build_sample_indices(
                self.indexed.sizes[s0:s1], s0, num_samples, seq_length, seed
            ),
        )
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc"],
            arrays["sample"],
            arrays["shuffle"],
        )

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def unshuffled_tokens(self, j: int) -> np.ndarray:
        """Tokens of sample ``j`` in stream order (before the shuffle),
        ``int64[seq_length + 1]``."""
        (p0, o0), (p1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        if p0 == p1:
            return self.indexed.get(int(self.doc_idx[p0]), o0, o1 - o0 + 1).astype(np.int64)
        parts = [self.indexed.get(int(self.doc_idx[p0]), o0)]
        parts += [self.indexed.get(int(self.doc_idx[p])) for p in range(p0 + 1, p1)]
        parts.append(self.indexed.get(int(self.doc_idx[p1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return {"tokens": torch.from_numpy(self.unshuffled_tokens(int(self.shuffle_idx[i])))}


def build_gpt_datasets(
    data_path: Sequence[str | float] | str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    cache_dir: str | os.PathLike | None = None,
    build_timeout_s: float = 1800.0,
    surplus: float = MID_LEVEL_SURPLUS,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets (None where 0 samples are asked) from ``--data-path``.

    Args:
        data_path: one prefix, a list of prefixes, or ``[w1, p1, w2, p2, ...]`` (Megatron's
            ``--data-path 0.3 A 0.7 B``), blended as Megatron-LM blends them
            (:mod:`data.blended_dataset`): weights normalised, each dataset built for
            ``ceil(ceil(n * w_i) * (1 + surplus))`` samples; a list without weights is weighted
            by the samples in one epoch of each dataset's split, each dataset built for one
            epoch (more only when the split asks for more samples than one epoch of all holds,
            where Megatron-LM's blend would run out; the samples then differ from Megatron's).
        split: ``"949,50,1"``-style string (:func:`data.split.parse_split`); each dataset is
            split by documents.
        seq_length: tokens per sample minus one.
        seed: shuffling seed.
        num_samples: ``(train, valid, test)`` samples needed.
        cache_dir: index cache directory (default: beside each dataset's files).
        build_timeout_s: how long other ranks wait for rank 0's index build.
        surplus: extra fraction of samples built per weighted dataset (Megatron-LM's
            ``--mid-level-dataset-surplus``, default 0.005).

    Returns:
        ``(train, valid, test)``; each a :class:`GPTDataset` or, for several prefixes, a
        :class:`data.blended_dataset.BlendedDataset` of exactly the requested length.

    Raises:
        ValueError: malformed split or data path, a split with no documents but samples asked,
            an unweighted blend's dataset with no sample in a split.
        RuntimeError / TimeoutError: the index build failed or stalled on another rank.
    """
    weights, prefixes = parse_data_path(data_path)
    fractions = parse_split(split)
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(
            f"num_samples must be three counts >= 0 (train, valid, test), got {num_samples}"
        )
    what = (
        f"GPT dataset indices for {prefixes} (split {split}, seq_length {seq_length}, seed {seed})"
    )
    return run_rank0_first(
        functools.partial(_build_splits, prefixes, weights, fractions, split, num_samples,
                          seq_length, seed, cache_dir, surplus),
        what, build_timeout_s)


def _build_splits(prefixes: list[str], weights: list[float] | None,
                  fractions: tuple[float, float, float], split: str,
                  num_samples: Sequence[int], seq_length: int, seed: int,
                  cache_dir: str | os.PathLike | None, surplus: float) -> tuple:
    """``(train, valid, test)`` of :func:`build_gpt_datasets` (building the indices, run on
    rank 0 first)."""
    indexed = [IndexedDataset(p) for p in prefixes]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        if n == 0:
            out.append(None)
            continue
        parts = [
            (p, split_ranges(fractions, len(d.document_indices) - 1)[s])
            for p, d in zip(prefixes, indexed, strict=True)
        ]
        extra = {"split_string": split}
        if len(prefixes) == 1 and weights is None:
            out.append(
                GPTDataset(
                    parts[0][0], parts[0][1], n, seq_length, seed, name, cache_dir, extra
                )
            )
            continue
        if weights is None:  # Megatron-LM: weighted by one epoch's samples of each dataset
            w = [_one_epoch_samples(d, p, rng, seq_length, name)
                 for d, (p, rng) in zip(indexed, parts, strict=True)]
            build = w
        else:  # Megatron-LM: normalised weights, each dataset built with a surplus
            w = normalize(weights)
            build = sizes_per_dataset(w, n, surplus)
        out.append(_blend(parts, w, build, n, seq_length, seed, name, cache_dir, extra))
    return tuple(out)


def _one_epoch_samples(
    indexed: IndexedDataset, prefix: str, document_range: tuple[int, int], seq_length: int,
    split_name: str,
) -> int:
    """Samples in one epoch of a split, ``(tokens - 1) // seq_length`` (Megatron-LM's length of a
    dataset built for no sample count); raises ValueError when that is 0."""
    d0, d1 = document_range
    s0, s1 = int(indexed.document_indices[d0]), int(indexed.document_indices[d1])
    tokens = int(np.asarray(indexed.sizes[s0:s1], np.int64).sum())
    if (tokens - 1) // seq_length < 1:
        raise ValueError(
            f"{split_name} split of {prefix} has {tokens} tokens, not one {seq_length + 1}-token "
            "sample; an unweighted --data-path blends by sample count, so every dataset needs "
            "one (give weights, or drop it)"
        )
    return (tokens - 1) // seq_length


def _blend(
    parts: list[tuple[str, tuple[int, int]]],
    w: list[float] | list[int],
    build: list[int],
    n: int,
    seq_length: int,
    seed: int,
    name: str,
    cache_dir: str | os.PathLike | None,
    extra: dict,
) -> BlendedDataset:
    """One split of several datasets blended by ``w`` (:func:`blending_indices`); dataset ``i``
    is built for ``max(build[i], samples drawn from it)`` samples, or not at all if none are."""
    prefixes = [os.path.abspath(p) for p, _ in parts]
    blend = load_or_build(
        cache_dir or Path(prefixes[0]).parent / "cache" / "GPTDataset_indices",
        f"BlendedDataset-{name}",
        {
            "class": "BlendedDataset",
            "version": INDEX_FORMAT_VERSION,
            "algorithm": "megatron-greedy",
            "weights": list(w),
            "prefixes": prefixes,
            "num_samples": n,
        },
        ("dataset", "sample"),
        lambda: dict(zip(("dataset", "sample"), blending_indices(w, n), strict=True)),
    )
    counts = np.bincount(blend["dataset"], minlength=len(parts))
    datasets = [
        GPTDataset(p, rng, max(int(c), b), seq_length, seed, name, cache_dir, extra) if c else None
        for (p, rng), c, b in zip(parts, counts, build, strict=True)
    ]
    return BlendedDataset(datasets, normalize(w), blend["dataset"], blend["sample"])
