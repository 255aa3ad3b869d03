"""``python -m data.preprocess --tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M``
writes the bytes Megatron-LM's ``tools/preprocess_data.py`` writes (issue 36): its token ids
are those of transformers' GPT-2 tokenizer on each text (here the pure-Python ``GPT2Tokenizer``,
OpenAI's algorithm, as the independent reference) plus ``<|endoftext|>`` with ``--append-eod``,
its files those of megatron-core's own ``IndexedDatasetBuilder``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data.preprocess import main

TEXTS = ["The quick brown fox jumps over the lazy dog.", "  leading spaces and\nnew lines\n\n",
         "naïve café — ünïcödé 🙂 and numbers 12345 67", "it's they're we've I'm you'll he'd",
         "the the the thethe  the\tthe"]


@pytest.fixture
def bpe_pair(tmp_path):
    """A small byte-level BPE vocabulary trained on the texts, saved as vocab.json/merges.txt."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS * 20, vocab_size=300, min_frequency=2,
                                special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    return tmp_path / "vocab.json", tmp_path / "merges.txt"


def megatron_files(prefix, docs: list[list[int]]):
    """megatron-core's writer, as its preprocess_data.py calls it (one sentence per document)."""
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except Exception as e:
        pytest.skip(f"megatron-core is not importable here ({type(e).__name__}: {e})")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in docs:
        builder.add_document(torch.IntTensor(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")


def test_gpt2_bpe_preprocessing_writes_megatrons_bytes(tmp_path, bpe_pair):
    from transformers import GPT2Tokenizer

    vocab, merges = bpe_pair
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    main(["--input", str(src), "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer",
          "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod",
          "--output-prefix", str(tmp_path / "ours"), "--no-progress"])
    slow = GPT2Tokenizer(str(vocab), str(merges))  # positional: transformers 5 ignores the
    eod = json.loads(vocab.read_text())["<|endoftext|>"]  # keywords (an empty tokenizer)
    docs = [slow(t)["input_ids"] + [eod] for t in TEXTS]
    assert all(len(d) > 3 for d in docs), docs  # the texts are encoded, not only the eod
    assert max(len(d) for d in docs) < max(len(t) for t in TEXTS)  # the merges are used
    megatron_files(tmp_path / "theirs", docs)
    bin_ids = np.fromfile(tmp_path / "ours_text_document.bin", dtype=np.uint16)
    assert len(bin_ids) == sum(map(len, docs)) and (bin_ids != eod).sum() > len(TEXTS) * 3
    for ext in (".bin", ".idx"):
        ours = (tmp_path / f"ours_text_document{ext}").read_bytes()
        assert ours == (tmp_path / f"theirs{ext}").read_bytes(), ext


def test_gpt2_bpe_flags_are_checked(tmp_path, bpe_pair, capsys):
    vocab, _ = bpe_pair
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(SystemExit):
        main(["--input", str(src), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
              str(vocab), "--output-prefix", str(tmp_path / "x")])
    assert "needs both --vocab-file and --merge-file" in capsys.readouterr().err
