"""Our .bin/.idx read by megatron-core's own reader (skipped when megatron-core is absent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import write_token_dataset

from data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def _megatron_reader():
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import (
                IndexedDataset as MegatronIndexedDataset,
            )
    except Exception as e:  # ImportError, or a megatron-core that fails to import on this torch
        pytest.skip(
            f"megatron-core is not importable here ({type(e).__name__}: {e}); "
            "install megatron-core>=0.16 to run this check"
        )
    return MegatronIndexedDataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_our_files(tmp_path, dtype):
    Megatron = _megatron_reader()
    rng = np.random.RandomState(1)
    docs = [rng.randint(0, 60_000, size=n).tolist() for n in (5, 1, 300, 17)]
    write_token_dataset(tmp_path / "ours", docs, dtype)
    theirs = Megatron(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    assert [theirs[i].tolist() for i in range(len(docs))] == docs
    assert theirs[2].dtype == np.dtype(dtype)
    assert theirs.sequence_lengths.tolist() == [len(d) for d in docs]
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    assert theirs.get(2, offset=10, length=5).tolist() == docs[2][10:15]


def test_we_read_megatron_core_files(tmp_path):
    Megatron = _megatron_reader()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in ([1, 2, 3], [4], [5, 6]):
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    assert [ours[i].tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    # and writing the same documents ourselves gives the same bytes
    with IndexedDatasetWriter(tmp_path / "mine", np.uint16) as w:
        for doc in ([1, 2, 3], [4], [5, 6]):
            w.add_document(np.array(doc))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"mine{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    assert len(Megatron(str(tmp_path / "mine"))) == 3
