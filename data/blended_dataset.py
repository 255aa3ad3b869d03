"""Blending several datasets by weight (Megatron's ``--data-path 0.3 A 0.7 B``).

The order in which datasets contribute samples is deterministic and follows the weights as
closely as possible at every prefix: dataset ``i``'s ``k``-th sample is due at "time"
``(k + 1/2) / w_i``, and samples are taken in order of due time (ties to the lower dataset
index). After ``n`` samples each dataset has contributed ``round(n * w_i)`` give or take one,
the same guarantee as Megatron-LM's greedy largest-error rule, but computed with one
vectorised sort instead of a C++ loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def parse_data_path(data_path: Sequence[str | float] | str) -> tuple[list[float] | None, list[str]]:
    """``(weights, prefixes)`` from a ``--data-path`` list; weights are None when none are given.

    Accepts ``"A"``, ``["A", "B"]`` (no weights) or ``[w1, "A", w2, "B"]`` (weights may be
    strings, as they come from the command line).

    Raises:
        ValueError: an empty list, an odd-length list that starts with a number, a weight that
            is not a positive finite number, or a mix of weighted and unweighted entries.
    """
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    if not items:
        raise ValueError("--data-path is empty")

    def number(x) -> float | None:
        try:
            return float(x)
        except (TypeError, ValueError):
            return None

    if number(items[0]) is None:
        if any(number(x) is not None for x in items):
            raise ValueError(
                f"--data-path {items}: mixes weights and prefixes; give a weight before every "
                "prefix"
            )
        return None, [str(x) for x in items]
    if len(items) % 2:
        raise ValueError(
            f"--data-path {items}: weighted form needs pairs 'weight prefix', got an odd count"
        )
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2], strict=True):
        wf = number(w)
        if wf is None or not math.isfinite(wf) or wf <= 0:
            raise ValueError(f"--data-path: weight {w!r} (for {p!r}) must be a positive number")
        weights.append(wf)
        prefixes.append(str(p))
    return weights, prefixes


def blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample, which dataset and which of its samples.

    Args:
        weights: ``[m]`` positive weights (normalised here).
        num_samples: blended length ``n``.

    Returns:
        ``(dataset_index int16/int32 [n], dataset_sample_index int64 [n])``; the samples taken
        from dataset ``i`` are ``0, 1, 2, ...`` in order.
    """
    w = np.asarray(weights, np.float64)
    w = w / w.sum()
    m = len(w)
    # dataset i contributes at most n*w_i + m/2 + 1 samples (the due-time bound); make that many
    per = [int(math.ceil(num_samples * wi + m / 2 + 1)) for wi in w]
    which = np.concatenate([np.full(c, i, np.int32) for i, c in enumerate(per)])
    local = np.concatenate([np.arange(c, dtype=np.int64) for c in per])
    due = (local + 0.5) / w[which]
    order = np.lexsort((which, due))[:num_samples]
    dtype = np.int16 if m < 2**15 else np.int32
    return which[order].astype(dtype), local[order]


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from several datasets in the order given by :func:`blending_indices`.

    ``len(ds) == len(dataset_index)``;
    ``ds[i] = datasets[dataset_index[i]][dataset_sample_index[i]]``. A dataset that is never drawn
    may be None.
    """

    def __init__(
        self,
        datasets: list,
        weights: np.ndarray,
        dataset_index: np.ndarray,
        dataset_sample_index: np.ndarray,
    ):
        self.datasets, self.weights = datasets, np.asarray(weights)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} blended samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
