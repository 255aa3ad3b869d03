"""Content-safe cache keys (issue 27, kind 8): a file rewritten with its old size and
modification time (``cp -p``, ``rsync -t``, ``tar x``, ``os.utime``) is never served from the
cache built for its old content."""

from __future__ import annotations

import os

import numpy as np
from data_helpers import write_jsonl, write_token_dataset

from data.gpt_dataset import build_gpt_datasets
from data.indexed_dataset import bin_path, idx_path
from data.text_source import iter_texts, load_text_dataset


def same_stat(path, keep: os.stat_result) -> None:
    assert os.stat(path).st_size == keep.st_size
    os.utime(path, ns=(keep.st_atime_ns, keep.st_mtime_ns))


def test_corpus_rewritten_with_same_size_and_mtime_is_read_again(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["alpha", "omega"])
    before = os.stat(src)

    def texts():
        ds = load_text_dataset(str(src), keys=["text"], cache_dir=str(tmp_path / "hf"))
        return list(iter_texts(ds, ["text"]))

    assert texts() == ["alpha", "omega"]
    write_jsonl(src, ["omega", "alpha"])
    same_stat(src, before)
    assert texts() == ["omega", "alpha"]


def test_token_dataset_rewritten_with_same_sizes_and_mtimes_gets_new_indices(tmp_path):
    prefix = tmp_path / "d"
    old = [[5] * 3, [6] * 9, [7] * 4, [8] * 8]
    new = [[5] * 9, [6] * 3, [7] * 8, [8] * 4]  # same count, tokens and file sizes
    write_token_dataset(prefix, old)
    stats = {p: os.stat(p) for p in (idx_path(prefix), bin_path(prefix))}
    first, _, _ = build_gpt_datasets([str(prefix)], "1", 5, 3, (6, 0, 0))
    write_token_dataset(prefix, new)
    for p, st in stats.items():
        same_stat(p, st)
    again, _, _ = build_gpt_datasets([str(prefix)], "1", 5, 3, (6, 0, 0))
    fresh, _, _ = build_gpt_datasets([str(prefix)], "1", 5, 3, (6, 0, 0),
                                     cache_dir=tmp_path / "fresh")
    assert not np.array_equal(first.sample_idx, fresh.sample_idx)
    for a, b in ((again.doc_idx, fresh.doc_idx), (again.sample_idx, fresh.sample_idx),
                 (again.shuffle_idx, fresh.shuffle_idx)):
        assert np.array_equal(a, b)
    assert [again[i]["tokens"].tolist() for i in range(len(again))] == [
        fresh[i]["tokens"].tolist() for i in range(len(fresh))]


def test_a_truncated_cached_index_is_named_and_rebuilt(tmp_path):
    """A cached ``.npy`` cut short (a copy or a full disk) was a 115-line traceback naming no
    file: it is named in one warning and rebuilt, and the arrays are the right ones."""
    import pytest

    from data.index_cache import load_or_build

    calls = []

    def build():
        calls.append(1)
        return {"a": np.arange(1000, dtype=np.int64), "b": np.ones(7)}

    first = {k: np.array(v) for k, v in load_or_build(tmp_path, "K", {"x": 1}, ("a", "b"),
                                                       build).items()}
    (a_file,) = tmp_path.glob("*-K-a.npy")
    a_file.write_bytes(a_file.read_bytes()[:500])
    with pytest.warns(RuntimeWarning, match=f"index cache file {a_file} is unreadable .*: "
                                             "rebuilding it"):
        again = load_or_build(tmp_path, "K", {"x": 1}, ("a", "b"), build)
    assert len(calls) == 2 and all(np.array_equal(first[k], again[k]) for k in first)
    assert np.array_equal(load_or_build(tmp_path, "K", {"x": 1}, ("a", "b"), build)["a"],
                          first["a"]) and len(calls) == 2  # whole again: read, not rebuilt
