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


def test_our_token_dtype_is_megatron_cores_choice_at_every_boundary():
    """Preprocessing here and in Megatron-LM picks the same dtype for a vocabulary, so the
    .bin files of one corpus are the same bytes (its preprocess_data.py calls optimal_dtype
    with the tokenizer's vocab_size)."""
    _megatron_reader()
    from megatron.core.datasets.indexed_dataset import DType

    from data.indexed_dataset import dtype_for_vocab

    for vocab in (1, 32_000, 50_257, 65_499, 65_500, 65_535, 65_536, 65_537, 128_256):
        assert dtype_for_vocab(vocab) == np.dtype(DType.optimal_dtype(vocab)), vocab


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


class _Tokenizer:
    """The little of a tokenizer that megatron-core's GPTDatasetConfig reads."""

    eod, pad, vocab_size = 0, -1, 1000
    unique_identifiers = {"class": "_Tokenizer"}


def _megatron_blend(prefixes, weights, n, seq_length, seed, split="100,0,0"):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights),
        split=split, path_to_cache=None, tokenizer=_Tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
    )
    sizes = list(n) if isinstance(n, tuple) else [n, 0, 0]
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return tuple(built) if isinstance(n, tuple) else built[0]


@pytest.mark.parametrize(
    "weights,n",
    [([0.3, 0.7], 30), (None, 40), ([2.0, 1.0, 0.5], 25), ([0.3, 0.7], 1000),
     ([1.0, 1e-3, 3.0], 517), ([1.0], 300), ([0.5, 0.5], 37)],
)
def test_blend_equals_megatron_cores(tmp_path, weights, n):
    """Our blend against megatron-core's BlendedMegatronDatasetBuilder on the same files (one
    epoch or many, with and without a separate last epoch): the same samples in the same order."""
    _megatron_reader()
    import warnings

    from data.gpt_dataset import build_gpt_datasets

    rng = np.random.RandomState(7)
    prefixes = []
    for k in range(3 if weights is None else len(weights)):
        docs = [rng.randint(100 * k + 1, 100 * k + 100, size=m).tolist()
                for m in rng.randint(1, 40, size=12)]
        prefixes.append(str(write_token_dataset(tmp_path / f"d{k}", docs)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _megatron_blend(prefixes, weights, n, 9, 5)
    data_path = prefixes if weights is None else [
        x for w, p in zip(weights, prefixes, strict=True) for x in (str(w), p)
    ]
    ours = build_gpt_datasets(data_path, "1", 9, 5, (n, 0, 0))[0]
    assert len(ours) == n <= len(theirs)
    assert ours.dataset_index.tolist() == theirs.dataset_index[:n].tolist()
    assert ours.dataset_sample_index.tolist() == theirs.dataset_sample_index[:n].tolist()
    for mine, megatron in zip(ours.datasets, theirs.datasets, strict=True):
        assert mine is None or len(mine) == len(megatron)  # built for the same samples
    for i in range(n):
        tokens = ours[i]["tokens"]
        assert tokens[:-1].tolist() == theirs[i]["tokens"].tolist()
        assert tokens[1:].tolist() == theirs[i]["labels"].tolist()


@pytest.mark.parametrize("n", [5, 23, 300, 331, 335])
def test_single_dataset_equals_megatron_cores(tmp_path, n):
    """``--data-path A`` (no blend): megatron-core's GPTDataset, sample for sample, for one epoch
    and many, with (n=300; n=331: 17 of the last epoch's 24 samples, under 80%) and without
    (n=335: 21 of 24) a separately shuffled last epoch."""
    _megatron_reader()
    import warnings

    from data.gpt_dataset import build_gpt_datasets

    rng = np.random.RandomState(3)
    docs = [rng.randint(1, 100, size=m).tolist() for m in rng.randint(1, 40, size=12)]
    prefix = str(write_token_dataset(tmp_path / "d", docs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _megatron_blend([prefix], None, n, 9, 11)
    ours = build_gpt_datasets(prefix, "1", 9, 11, (n, 0, 0))[0]
    assert len(ours) == len(theirs) >= n
    assert ours.doc_idx.tolist() == theirs.document_index.tolist()
    assert ours.shuffle_idx.tolist() == theirs.shuffle_index.tolist()
    for i in range(len(ours)):
        assert ours[i]["tokens"][:-1].tolist() == theirs[i]["tokens"].tolist()


@pytest.mark.parametrize("weights", [None, [0.4, 0.6]])
def test_train_valid_test_splits_equal_megatron_cores(tmp_path, weights):
    """``--split 8,1,1``: every split, single dataset and weighted blend, sample for sample."""
    _megatron_reader()
    import warnings

    from data.gpt_dataset import build_gpt_datasets

    rng = np.random.RandomState(5)
    prefixes = []
    for k in range(1 if weights is None else 2):
        docs = [rng.randint(1, 100, size=m).tolist() for m in rng.randint(1, 40, size=37)]
        prefixes.append(str(write_token_dataset(tmp_path / f"p{k}", docs)))
    sizes = (200, 30, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _megatron_blend(prefixes, weights, sizes, 7, 9, split="8,1,1")
    data_path = prefixes[0] if weights is None else ["0.4", prefixes[0], "0.6", prefixes[1]]
    ours = build_gpt_datasets(data_path, "8,1,1", 7, 9, sizes)
    for mine, megatron, n in zip(ours, theirs, sizes, strict=True):
        for i in range(n):
            assert mine[i]["tokens"][:-1].tolist() == megatron[i]["tokens"].tolist()
