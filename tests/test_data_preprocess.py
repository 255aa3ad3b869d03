"""Preprocessing: row policy, errors, file formats, merging shards."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from data_helpers import tiny_corpus, tiny_tokenizer, write_jsonl

from data.indexed_dataset import IndexedDataset
from data.merge import main as merge_main
from data.preprocess import main as preprocess_main
from data.preprocess import preprocess
from data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _run(tmp_path, inputs, model, **kw):
    return preprocess(
        inputs, tmp_path / "out", model, cache_dir=str(tmp_path / "hf"), progress=False, **kw
    )


def test_acceptance_five_documents(tmp_path, model):
    """Whitespace policy: empty and whitespace-only texts are empty documents, no sample."""
    src = write_jsonl(tmp_path / "five.jsonl", ["", "hello world", "   ", "é😀 ok", ""])
    stats = _run(tmp_path, str(src), model, append_eod=True)
    tok = Tokenizer(model)
    ds = IndexedDataset(tmp_path / "out_text_document")
    expected = [ids + [tok.eod] for ids in tok.encode(["hello world", "é😀 ok"])]
    assert len(ds) == 2 and [ds[i].tolist() for i in range(2)] == expected
    assert ds.document_indices.tolist() == [0, 1, 2]
    assert np.fromfile(tmp_path / "out_text_document.bin", np.uint16).tolist() == sum(expected, [])
    assert tok.decode(ds[1][:-1].tolist()) == "é😀 ok"
    ks = stats.keys["text"]
    assert (ks.documents, ks.empty, ks.invalid, ks.tokens) == (2, 3, 0, len(sum(expected, [])))


def test_invalid_rows_are_skipped_and_counted(tmp_path, model):
    src = write_jsonl(
        tmp_path / "mixed.jsonl", [{"text": "a b"}, {"text": None}, {"other": "x"}, {"text": "c"}]
    )
    with pytest.warns(UserWarning, match=r"missing, null or not a string: \{'text': 2\}"):
        stats = _run(tmp_path, [str(src)], model)
    assert (
        stats.keys["text"].documents == 2
        and len(IndexedDataset(tmp_path / "out_text_document")) == 2
    )


def test_clear_errors_and_no_partial_outputs(tmp_path, model):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x", "body": "y"}])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        _run(tmp_path, [str(tmp_path / "missing.jsonl")], model)
    with pytest.raises(
        KeyError, match=r"\['txt'\] not in the dataset; its columns are \['text', 'body'\]"
    ):
        _run(tmp_path, [str(src)], model, json_keys=["txt"])
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(ValueError, match="cannot read sentencepiece model"):
        _run(tmp_path, [str(src)], tmp_path / "junk.model")
    blank = write_jsonl(
        tmp_path / "blank.jsonl", [{"text": " ", "body": "fine"}, {"text": None, "body": "ok"}]
    )
    with pytest.raises(ValueError, match="empty result: no document for key 'text'"):
        _run(tmp_path, [str(blank)], model, json_keys=["body", "text"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []


def test_formats_and_several_keys(tmp_path, model):
    rows = [{"text": "alpha beta", "title": "A"}, {"text": "gamma", "title": "B"}]
    d = datasets.Dataset.from_list(rows)
    d.to_parquet(str(tmp_path / "r.parquet"))
    d.to_csv(str(tmp_path / "r.csv"), index=False)
    d.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "r.txt").write_text("alpha beta\ngamma\n")
    tok = Tokenizer(model)
    want = tok.encode(["alpha beta", "gamma"])
    for i, src in enumerate(["r.parquet", "r.csv", "saved", "r.txt"]):
        out = tmp_path / f"o{i}"
        preprocess(
            [str(tmp_path / src)], out, model, cache_dir=str(tmp_path / "hf"), progress=False
        )
        ds = IndexedDataset(f"{out}_text_document")
        assert [ds[j].tolist() for j in range(len(ds))] == want, src
    preprocess(
        [str(tmp_path / "r.parquet")],
        tmp_path / "k",
        model,
        ["text", "title"],
        progress=False,
        cache_dir=str(tmp_path / "hf"),
    )
    assert IndexedDataset(tmp_path / "k_title_document")[1].tolist() == tok.encode(["B"])[0]


def test_three_shards_merged_equal_the_concatenation(tmp_path, model):
    lines = tiny_corpus(tmp_path, 60_000).read_text(encoding="utf-8").splitlines()
    lines.insert(3, json.dumps({"text": "  "}))  # a skipped row inside a shard
    thirds = [
        lines[: len(lines) // 3],
        lines[len(lines) // 3 : 2 * len(lines) // 3],
        lines[2 * len(lines) // 3 :],
    ]
    for i, part in enumerate(thirds):
        (tmp_path / f"s{i}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")
        preprocess(
            [str(tmp_path / f"s{i}.jsonl")],
            tmp_path / f"shard{i}",
            model,
            append_eod=True,
            progress=False,
            cache_dir=str(tmp_path / "hf"),
            chunk_documents=4,
        )
    (tmp_path / "all.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # the whole file through the CLI with 2 worker processes: worker count must not change bytes
    preprocess_main(
        [
            "--input",
            str(tmp_path / "all.jsonl"),
            "--tokenizer-model",
            str(model),
            "--output-prefix",
            str(tmp_path / "whole"),
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
            "--cache-dir",
            str(tmp_path / "hf"),
        ]
    )
    merge_main(
        ["--input"]
        + [str(tmp_path / f"shard{i}_text_document") for i in range(3)]
        + ["--output-prefix", str(tmp_path / "merged")]
    )
    for ext in (".bin", ".idx"):
        # named as preprocess names its output (issue 28 item 6): merged_text_document
        assert (tmp_path / f"merged_text_document{ext}").read_bytes() == (
            tmp_path / f"whole_text_document{ext}"
        ).read_bytes()
    assert len(IndexedDataset(tmp_path / "merged_text_document")) == len(lines) - 1
