"""Blending follows Megatron-LM: its weights, per-dataset sizes and greedy sample order.

The reference below is Megatron-LM's algorithm written out from its source (NVIDIA/Megatron-LM,
``megatron/core/datasets/helpers.cpp`` ``build_blending_indices``; weights normalised by
``megatron/core/datasets/utils.py`` ``normalize`` in ``blended_megatron_dataset_builder.py`` and
again in ``blended_dataset.py``; sizes from ``_get_size_per_split_per_dataset`` with
``mid_level_dataset_surplus`` 0.005; an unweighted blend weighted by ``len()`` of each dataset
built for one epoch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from data_helpers import write_token_dataset

from data.blended_dataset import blending_indices, normalize, sizes_per_dataset
from data.gpt_dataset import build_gpt_datasets

WEIGHTS = [[0.3, 0.7], [1, 1, 1], [0.2, 0.5, 0.3], [5, 1, 0.5, 3.3], [1e-3, 1], [30, 70]]
SIZES = [0, 1, 2, 3, 17, 1000]


def megatron_normalize(weights) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def megatron_greedy(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's ``build_blending_indices``: the dataset with the largest
    ``weight * max(sample, 1) - taken`` (first on ties) gives its next sample."""
    w = np.array(weights, np.float64)
    taken = np.zeros(len(w), np.int64)
    dataset_index = np.zeros(size, np.int16)
    dataset_sample_index = np.zeros(size, np.int64)
    for k in range(size):
        error = w * max(float(k), 1.0) - taken.astype(np.float64)
        d = int(np.argmax(error))
        dataset_index[k], dataset_sample_index[k] = d, taken[d]
        taken[d] += 1
    return dataset_index, dataset_sample_index


def megatron_sizes(weights, size: int, surplus: float) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_greedy_blend_equals_megatron(weights):
    for n in SIZES:
        which, local = blending_indices(weights, n)
        ref_which, ref_local = megatron_greedy(megatron_normalize(weights), n)
        assert which.tolist() == ref_which.tolist(), (weights, n)
        assert local.tolist() == ref_local.tolist(), (weights, n)
    w = megatron_normalize(weights)
    assert normalize(weights) == w
    for n, surplus in [(1, 0.0), (999, 0.0), (999, 0.005), (123457, 0.005), (10, 0.5)]:
        assert sizes_per_dataset(w, n, surplus) == megatron_sizes(w, n, surplus)
    with pytest.raises(ValueError, match="positive"):
        blending_indices([0.5, 0.0], 3)


def _tokens(prefix_docs) -> int:
    return sum(map(len, prefix_docs))


@pytest.fixture
def two(tmp_path):
    docs_a = [[1] * 37] * 5 + [[1] * 11]  # 196 tokens
    docs_b = [[2] * 23] * 13  # 299 tokens
    a = str(write_token_dataset(tmp_path / "a", docs_a))
    b = str(write_token_dataset(tmp_path / "b", docs_b))
    return a, b, _tokens(docs_a), _tokens(docs_b)


@pytest.mark.parametrize("weights,n", [([0.3, 0.7], 1000), ([2.0, 1.0], 57), ([1.0, 1e-3], 5)])
def test_weighted_data_path_is_megatrons_blend(two, weights, n):
    a, b, _, _ = two
    data_path = [str(weights[0]), a, str(weights[1]), b]
    train, _, _ = build_gpt_datasets(data_path, "1", 9, 1, (n, 0, 0))
    w = megatron_normalize(weights)  # the builder's normalisation
    ref_which, ref_local = megatron_greedy(megatron_normalize(w), n)  # and the blend's again
    assert train.dataset_index.tolist() == ref_which.tolist()
    assert train.dataset_sample_index.tolist() == ref_local.tolist()
    for ds, size in zip(train.datasets, megatron_sizes(w, n, 0.005), strict=True):
        assert ds is None or ds.description["num_samples"] == size  # the 0.5% surplus
    again, _, _ = build_gpt_datasets(data_path, "1", 9, 1, (n, 0, 0), cache_dir=two[0] + "_c")
    assert [int(again[i]["tokens"][0]) for i in range(n)] == [
        int(train[i]["tokens"][0]) for i in range(n)
    ]  # a pure function of the settings: a rebuilt cache gives the same samples


def test_unweighted_data_path_blends_by_one_epoch_sample_counts(two, tmp_path):
    a, b, tokens_a, tokens_b = two
    seq = 9
    epoch = [(tokens_a - 1) // seq, (tokens_b - 1) // seq]  # 21 and 33 samples
    cap = sum(epoch)
    for n in (1, 20, cap):
        train, _, _ = build_gpt_datasets([a, b], "1", seq, 4, (n, 0, 0))
        ref_which, ref_local = megatron_greedy(megatron_normalize(epoch), n)
        assert train.dataset_index.tolist() == ref_which.tolist()
        assert train.dataset_sample_index.tolist() == ref_local.tolist()
        for ds, e in zip(train.datasets, epoch, strict=True):
            assert ds is None or len(ds) == e  # built for one epoch, as Megatron-LM does
    # more than Megatron-LM's blend holds: the same first `cap` samples, then on by the rule
    longer, _, _ = build_gpt_datasets([a, b], "1", seq, 4, (3 * cap, 0, 0))
    assert longer.dataset_index[:cap].tolist() == ref_which.tolist()
    ref_long, _ = megatron_greedy(megatron_normalize(epoch), 3 * cap)
    assert longer.dataset_index.tolist() == ref_long.tolist()
    tiny = str(write_token_dataset(tmp_path / "tiny", [[3] * 5]))
    with pytest.raises(ValueError, match="tiny has 5 tokens"):
        build_gpt_datasets([a, tiny], "1", seq, 4, (10, 0, 0))


def test_mid_level_dataset_surplus(two):
    from hybrid.config import DataConfig
    from hybrid.config_fields import ConfigError

    a, b, _, _ = two
    w, n = megatron_normalize([0.3, 0.7]), 2000
    train, _, _ = build_gpt_datasets(["0.3", a, "0.7", b], "1", 9, 1, (n, 0, 0), surplus=0.25)
    sizes = [ds.description["num_samples"] for ds in train.datasets]
    assert sizes == megatron_sizes(w, n, 0.25) != megatron_sizes(w, n, 0.005)
    assert DataConfig().mid_level_dataset_surplus == 0.005  # Megatron-LM's default
    with pytest.raises(ConfigError, match="--mid-level-dataset-surplus -0.1 .* >= 0"):
        DataConfig(mid_level_dataset_surplus=-0.1)
