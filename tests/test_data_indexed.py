"""The Megatron-LM indexed dataset format: writer, reader, merge."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from data_helpers import write_token_dataset

from data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    merge_datasets,
)

DOCS = [[5, 6, 7], [1], [65535, 0, 2, 9], [3, 3]]


def test_index_layout_is_megatrons(tmp_path):
    prefix = write_token_dataset(tmp_path / "d", DOCS, np.uint16)
    raw = (tmp_path / "d.idx").read_bytes()
    magic, version, code, n, d1 = struct.unpack_from("<9sQBQQ", raw)
    assert (magic, version, code, n, d1) == (b"MMIDIDX\x00\x00", 1, 8, 4, 5)
    off = struct.calcsize("<9sQBQQ")
    assert off == 34
    sizes = np.frombuffer(raw, np.int32, 4, off)
    pointers = np.frombuffer(raw, np.int64, 4, off + 16)
    docs = np.frombuffer(raw, np.int64, 5, off + 48)
    assert sizes.tolist() == [3, 1, 4, 2]
    assert pointers.tolist() == [0, 6, 8, 16]  # bytes, uint16 tokens
    assert docs.tolist() == [0, 1, 2, 3, 4]
    assert len(raw) == off + 48 + 40
    assert np.fromfile(tmp_path / "d.bin", np.uint16).tolist() == sum(DOCS, [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.dtype == np.uint16 and ds.num_tokens == 10
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds[-1].tolist() == [3, 3] and ds.get(2, 1, 2).tolist() == [0, 2]
    with pytest.raises(IndexError):
        ds[4]


def test_dtype_from_vocab_size():
    # Megatron-LM's DType.optimal_dtype: uint16 below 65,500, int32 from there on
    assert dtype_for_vocab(1) == dtype_for_vocab(50_257) == dtype_for_vocab(65_499) == np.uint16
    assert dtype_for_vocab(65_500) == dtype_for_vocab(65_536) == np.int32
    assert dtype_for_vocab(128_256) == np.int32
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


def test_multi_sequence_documents_and_empty_dataset(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s", np.int32) as w:
        w.add_sequences(np.array([1, 2, 3, 4, 5]), np.array([2, 3]), end_document=False)
        w.end_document()
        w.add_document(np.array([7]))
    ds = IndexedDataset(tmp_path / "s")
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.sizes.tolist() == [2, 3, 1] and ds.pointers.tolist() == [0, 8, 20]
    with IndexedDatasetWriter(tmp_path / "e", np.uint16):
        pass
    empty = IndexedDataset(tmp_path / "e")
    assert len(empty) == 0 and empty.document_indices.tolist() == [0]


def test_failure_leaves_nothing_and_ids_must_fit(tmp_path):
    with pytest.raises(ValueError, match="outside uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document(np.array([1, 70_000]))
    assert list(tmp_path.iterdir()) == []


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        IndexedDataset(tmp_path / "nope")
    write_token_dataset(tmp_path / "d", DOCS)
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(tmp_path / "d")


def test_merge_is_byte_identical_to_writing_everything(tmp_path):
    shards = [DOCS[:1], DOCS[1:3], DOCS[3:]]
    prefixes = [write_token_dataset(tmp_path / f"shard{i}", s) for i, s in enumerate(shards)]
    write_token_dataset(tmp_path / "whole", DOCS)
    merged = merge_datasets(prefixes, tmp_path / "merged")
    assert [merged[i].tolist() for i in range(len(merged))] == DOCS
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()
    write_token_dataset(tmp_path / "wide", [[1]], np.int32)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_datasets([prefixes[0], tmp_path / "wide"], tmp_path / "bad")
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()


def _corrupt(prefix, array: str, i: int, value: int) -> None:
    """Overwrite element ``i`` of the index's ``sizes`` / ``pointers`` / ``docs`` in place (the
    file keeps its size)."""
    n = len(IndexedDataset(prefix))
    offsets = {"sizes": (34, np.int32), "pointers": (34 + 4 * n, np.int64),
               "docs": (34 + 12 * n, np.int64)}
    off, dtype = offsets[array]
    raw = np.memmap(f"{prefix}.idx", np.uint8, "r+")
    np.ndarray(n + 1, dtype, raw, off)[i] = value
    raw.flush()


@pytest.mark.parametrize(("array", "i", "value", "why"), [
    ("sizes", 2, -4, "sequence 2 (document 2) has a negative length (-4 tokens)"),
    ("sizes", 1, 3, "sequence 1 (document 1) has a length of 3 tokens, but the next sequence "
                    "starts 1 tokens after it"),
    ("pointers", 3, 17, "sequence 2 (document 2) has a length of 4 tokens, but the next sequence "
                        "starts 4.5 tokens after it"),
    ("pointers", 0, 2, "sequence 0 (document 0) starts at byte 2 of the .bin file, not 0"),
    ("docs", 2, 4, "document 3 starts at sequence 3, before document 2 (sequence 4)"),
    ("docs", 4, 3, "the document boundaries span sequences 0 .. 3, not 0 .. 4 (the sequence "
                   "count)"),
])
def test_corrupt_index_arrays_are_refused_naming_the_first_bad_sequence(tmp_path, array, i,
                                                                        value, why):
    """A flipped length in an ``.idx`` of the right size trained silently on other tokens."""
    prefix = write_token_dataset(tmp_path / "d", DOCS)
    _corrupt(prefix, array, i, value)
    with pytest.raises(ValueError) as e:
        IndexedDataset(prefix)
    assert str(e.value) == (f"{prefix}.idx is corrupt: {why}; preprocess the data again (or "
                            "restore the file)")
