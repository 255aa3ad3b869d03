"""GPT samples, their cached indices, splits and blending."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import write_token_dataset

import data.gpt_dataset as gpt
from data.blended_dataset import blending_indices, parse_data_path
from data.gpt_dataset import build_gpt_datasets, build_sample_indices
from data.indexed_dataset import IndexedDataset
from data.split import parse_split, split_ranges

RNG = np.random.RandomState(0)
DOCS = [list(RNG.randint(4, 500, size=n)) for n in RNG.randint(1, 40, size=30)] + [[]]  # one empty


@pytest.fixture
def prefix(tmp_path):
    return str(write_token_dataset(tmp_path / "d", DOCS))


def _stream(ds) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_samples_tile_the_document_stream(prefix, seq_length):
    tokens = sum(map(len, DOCS))
    one_epoch = (tokens - 1) // seq_length
    train, _, _ = build_gpt_datasets(prefix, "1", seq_length, 3, (one_epoch, 0, 0))
    assert len(train.doc_idx) == len(DOCS)  # exactly one epoch, every document once
    assert sorted(train.doc_idx.tolist()) == list(range(len(DOCS)))
    samples = [train.unshuffled_tokens(j) for j in range(len(train))]
    assert all(len(s) == seq_length + 1 for s in samples)
    got = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    assert np.array_equal(got, _stream(train)[: len(got)])  # no gap, no overlap
    assert len(got) == one_epoch * seq_length + 1
    assert sorted(train.shuffle_idx.tolist()) == list(range(len(train)))
    item = train[0]["tokens"]
    assert item.dtype.is_floating_point is False and item.shape == (seq_length + 1,)


def test_epochs_seed_and_cache(prefix, tmp_path, monkeypatch):
    train, _, _ = build_gpt_datasets([prefix], "1", 16, 5, (100, 0, 0))
    tokens = sum(map(len, DOCS))
    epochs = len(train.doc_idx) // len(DOCS)
    assert epochs == -(-(100 * 16 + 1) // tokens) and len(train) >= 100
    full = ((epochs - 1) * tokens - 1) // 16  # samples before the last epoch
    # Megatron-LM's rule: all epochs shuffled together unless the last is asked for under 80% of
    # its samples, then it is shuffled apart and comes last
    assert 100 - full >= int(0.8 * ((tokens - 1) // 16))
    assert np.bincount(train.doc_idx).tolist() == [epochs] * len(DOCS)
    assert sorted(train.doc_idx[: len(DOCS)].tolist()) != list(range(len(DOCS)))
    apart = build_sample_indices(IndexedDataset(prefix).sizes, 0, full + 5, 16, 5)
    assert len(apart["doc"]) == epochs * len(DOCS) and 5 < int(0.8 * ((tokens - 1) // 16))
    first = apart["doc"][: (epochs - 1) * len(DOCS)]
    assert np.bincount(first, minlength=len(DOCS)).tolist() == [epochs - 1] * len(DOCS)
    assert sorted(apart["doc"][len(first) :].tolist()) == list(range(len(DOCS)))
    assert sorted(apart["shuffle"][:full].tolist()) == list(range(full))
    assert np.array_equal(
        _stream(train)[: len(train) * 16],
        np.concatenate([train.unshuffled_tokens(j)[:-1] for j in range(len(train))]),
    )
    cache = tmp_path / "cache" / "GPTDataset_indices"
    assert len(list(cache.glob("*-GPTDataset-train-*.npy"))) == 3

    def no_rebuild(*a, **k):
        raise AssertionError("indices rebuilt despite the cache")

    monkeypatch.setattr(gpt, "build_sample_indices", no_rebuild)
    again, _, _ = build_gpt_datasets([prefix], "1", 16, 5, (100, 0, 0))  # same settings: cache hit
    assert [again[i]["tokens"].tolist() for i in range(20)] == [
        train[i]["tokens"].tolist() for i in range(20)
    ]
    with pytest.raises(AssertionError, match="rebuilt"):  # another seed: another cache entry
        build_gpt_datasets([prefix], "1", 16, 6, (100, 0, 0))
    monkeypatch.undo()
    other, _, _ = build_gpt_datasets([prefix], "1", 16, 6, (100, 0, 0), cache_dir=tmp_path / "c2")
    assert not np.array_equal(other.shuffle_idx, train.shuffle_idx)


def test_build_sample_indices_is_deterministic_and_checks_input():
    sizes = np.array([3, 0, 5, 2])
    a, b = build_sample_indices(sizes, 10, 9, 4, 1), build_sample_indices(sizes, 10, 9, 4, 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["doc"].min() >= 10
    with pytest.raises(ValueError, match="cannot make"):
        build_sample_indices(np.array([1, 0]), 0, 1, 4, 1)


def test_splits(prefix):
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split(" 98 , 2 ") == pytest.approx((0.98, 0.02, 0.0))
    for bad in ["-1,1,0", "90,abc5,5", "0,0,0", "", "1,2,3,4", "nan,1,1", "1,,1", "1e3,1,1"]:
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    ranges = split_ranges(parse_split("8,1,1"), 31)
    assert ranges[0][0] == 0 and ranges[-1][1] == 31
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
    train, valid, test = build_gpt_datasets(prefix, "8,1,1", 8, 1, (10, 3, 0))
    assert test is None
    assert set(train.doc_idx.tolist()) == set(range(*ranges[0]))
    assert set(valid.doc_idx.tolist()) == set(range(*ranges[1]))
    with pytest.raises(ValueError, match="test split .* has no documents"):
        build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 2))


def test_blending(tmp_path):
    a = str(write_token_dataset(tmp_path / "a", [[1] * 50] * 4))
    b = str(write_token_dataset(tmp_path / "b", [[2] * 50] * 4))
    train, _, _ = build_gpt_datasets(["0.3", a, "0.7", b], "1", 9, 1, (1000, 0, 0))
    assert len(train) == 1000
    counts = np.bincount(train.dataset_index)
    assert counts.tolist() == [300, 700]
    firsts = [int(train[i]["tokens"][0]) for i in range(1000)]
    assert firsts.count(1) == 300 and firsts.count(2) == 700
    which, local = blending_indices(np.array([0.2, 0.5, 0.3]), 997)
    for n in (1, 10, 100, 997):  # every prefix follows the weights within one sample
        c = np.bincount(which[:n], minlength=3)
        assert np.all(np.abs(c - n * np.array([0.2, 0.5, 0.3])) <= 1)
    for i in range(3):
        assert local[which == i].tolist() == list(range(int((which == i).sum())))
    plain, _, _ = build_gpt_datasets([a, b], "1", 9, 1, (10, 0, 0))  # by one-epoch samples
    assert np.bincount(plain.dataset_index).tolist() == [5, 5]


def test_data_path_parsing():
    assert parse_data_path("x") == (None, ["x"])
    assert parse_data_path(["0.3", "A", 0.7, "B"]) == ([0.3, 0.7], ["A", "B"])
    for bad in [[], ["0.3", "A", "0.7"], ["0", "A"], ["-1", "A"], ["A", "0.5", "B"], ["nan", "A"]]:
        with pytest.raises(ValueError, match="data-path"):
            parse_data_path(bad)


def test_dataset_reads_megatron_documents_with_several_sequences(tmp_path):
    from data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "m", np.uint16) as w:
        for d in range(6):
            w.add_sequences(np.arange(10) + d * 10, np.array([4, 6]), end_document=False)
            w.end_document()
    assert len(IndexedDataset(tmp_path / "m").document_indices) == 7
    train, valid, _ = build_gpt_datasets(str(tmp_path / "m"), "2,1", 5, 0, (8, 2, 0))
    assert set(train.doc_idx.tolist()) == set(range(8))  # documents 0-3 = sequences 0-7
    assert set(valid.doc_idx.tolist()) == set(range(8, 12))
