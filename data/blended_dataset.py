"""Blending several datasets as Megatron-LM does (``--data-path 0.3 A 0.7 B`` or ``A B``).

The blend is a pure function of the weights and the blended length, so every rank, grid and
resumed run sees the same order:

* **weights** are normalised to sum to 1 (:func:`normalize`); an unweighted ``--data-path A B``
  is weighted by each dataset's one-epoch sample count of the split (see
  :func:`data.gpt_dataset.build_gpt_datasets`).
* **order** (:func:`blending_indices`): Megatron-LM's greedy rule. Before blended sample ``k``
  each dataset ``i`` has contributed ``c_i`` samples; the sample comes from the dataset with the
  largest error ``w_i * max(k, 1) - c_i`` (ties to the lower index), and it is that dataset's
  sample ``c_i``. The blend itself is not shuffled; each dataset shuffles its own samples.
* **sizes** (:func:`sizes_per_dataset`): for ``n`` blended samples dataset ``i`` is built for
  ``ceil(ceil(n * w_i) * (1 + surplus))`` samples (surplus 0.005, Megatron-LM's
  ``mid_level_dataset_surplus``).

The rule is prefix-stable: the first ``n'`` samples of a blend of ``n >= n'`` are the blend of
``n'``. After ``n`` samples dataset ``i`` has contributed ``n * w_i`` within two samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

MID_LEVEL_SURPLUS = 0.005  # Megatron-LM's default --mid-level-dataset-surplus


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


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64, as Python floats ``[m]``.

    Raises:
        ValueError: an empty list, or a weight that is not a positive finite number.
    """
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights {list(weights)} must be positive finite numbers")
    return (w / w.sum()).tolist()


def sizes_per_dataset(
    normalized_weights: Sequence[float], num_samples: int, surplus: float = 0.0
) -> list[int]:
    """Samples to build from each dataset for a blend of ``num_samples``:
    ``ceil(ceil(num_samples * w_i) * (1 + surplus))`` (Megatron-LM's per-dataset sizes; the
    targets with ``surplus=0``, what is built with ``surplus=MID_LEVEL_SURPLUS``).

    Raises:
        ValueError: ``num_samples < 0`` or ``surplus < 0``.
    """
    if num_samples < 0 or surplus < 0:
        raise ValueError(f"num_samples ({num_samples}) and surplus ({surplus}) must be >= 0")
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus))) for w in normalized_weights]


def blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample, which dataset and which of its samples (Megatron-LM's greedy rule,
    see the module docstring). Runs in Python: about 0.25 s per million samples of two datasets.

    Args:
        weights: ``[m]`` positive weights (normalised here with :func:`normalize`, as Megatron-LM
            normalises them again in its blended dataset).
        num_samples: blended length ``n >= 0``.

    Returns:
        ``(dataset_index int16/int32 [n], dataset_sample_index int64 [n])``; the samples taken
        from dataset ``i`` are ``0, 1, 2, ...`` in order.

    Raises:
        ValueError: bad weights (see :func:`normalize`) or ``num_samples < 0``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    w = normalize(weights)
    m = len(w)
    counts = [0] * m
    which, local = [0] * num_samples, [0] * num_samples
    rest = range(1, m)
    for k in range(num_samples):
        x = float(k) if k > 0 else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for i in rest:
            err = w[i] * x - counts[i]
            if err > best_err:
                best, best_err = i, err
        which[k], local[k] = best, counts[best]
        counts[best] += 1
    dtype = np.int16 if m < 2**15 else np.int32
    return np.array(which, dtype), np.array(local, np.int64)


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
