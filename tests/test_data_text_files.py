"""Reading local text files: bad bytes, empty files, extra keys, byte-order marks (issue 13,
items 12-15), through the reader and through both command lines."""

from __future__ import annotations

import json

import pytest
from data_helpers import tiny_corpus, tiny_tokenizer, write_jsonl

from data.indexed_dataset import IndexedDataset
from data.preprocess import main as preprocess_main
from data.preprocess import preprocess
from data.text_source import iter_texts, load_text_dataset, open_text_dataset
from data.tokenizer import Tokenizer
from data.train_tokenizer import main as train_main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _texts(path, tmp_path, keys=("text",)):
    ds = load_text_dataset(path, keys=list(keys), cache_dir=str(tmp_path / "hf"))
    return list(iter_texts(ds, list(keys)))


def test_invalid_utf8_row_is_skipped_and_named(tmp_path):
    """Item 12: one 0xff byte inside a text (line 2) aborted the whole read with a
    UnicodeDecodeError naming neither file nor line."""
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "hello"}\n{"text": "bad \xff here"}\n{"text": "ok"}\n')
    with pytest.warns(
        UserWarning,
        match=r"skipped 1 unreadable row\(s\) of 3: .*bad.jsonl:2: "
        r"invalid UTF-8 byte 0xff at character 4 in 'text'",
    ):
        ds, report = open_text_dataset(str(src), cache_dir=str(tmp_path / "hf"))
    assert list(iter_texts(ds, ["text"])) == ["hello", "ok"]
    assert (report.rows, report.unreadable) == (2, 1)
    # the same kind in every format and place: a bad byte in .txt and .csv rows, a line that is
    # not JSON, a lone surrogate escaped in JSON; a bad byte in a key not read is no fault
    (tmp_path / "b.txt").write_bytes(b"one\ntw\xc3o\nthree\n")
    with pytest.warns(UserWarning, match=r"b.txt:2: invalid UTF-8 byte 0xc3 at byte 2"):
        assert _texts(str(tmp_path / "b.txt"), tmp_path) == ["one", "three"]
    (tmp_path / "b.csv").write_bytes(b'text,n\n"multi\nline",1\nx\xfey,2\nfine,3\n')
    with pytest.warns(UserWarning, match=r"b.csv:4: invalid UTF-8 byte 0xfe"):
        assert _texts(str(tmp_path / "b.csv"), tmp_path) == ["multi\nline", "fine"]
    (tmp_path / "m.jsonl").write_bytes(
        b'{"text": "a"}\n{"text": "b"\n[1]\n{"text": "\\ud800"}\n{"text": "c", "src": "\xff"}\n'
    )
    with pytest.warns(
        UserWarning,
        match=r"skipped 3 unreadable row\(s\) of 5: .*m.jsonl:2: not "
        r"JSON .*m.jsonl:3: a JSON list, not an object; .*m.jsonl:4: lone surrogate",
    ):
        assert _texts(str(tmp_path / "m.jsonl"), tmp_path) == ["a", "c"]


@pytest.mark.parametrize("content", [b"", b"\n\n\n", b"\xef\xbb\xbf\n", b'{"text": "  "}\n'])
def test_file_without_documents_is_named(tmp_path, content):
    """Item 13: an empty file gave a bare StopIteration, blank lines 'Instruction "train"
    corresponds to no data!'."""
    for name in ("e.jsonl", "e.txt") if content[:1] != b"{" else ("e.jsonl",):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"^no documents in .*{name} \("):
            _texts(str(tmp_path / name), tmp_path)
    # with other files that do have documents: read, and the empty one is named in a warning
    write_jsonl(tmp_path / "full.jsonl", ["x"])
    with pytest.warns(UserWarning, match=r"no documents in .*e.jsonl$"):
        texts = _texts([str(tmp_path / "e.jsonl"), str(tmp_path / "full.jsonl")], tmp_path)
    assert [t for t in texts if t.strip()] == ["x"]


def test_only_the_requested_keys_are_read(tmp_path):
    """Item 14: 60,000 rows of {"text"} and one with an extra key "source" failed with a
    CastError (the key appears after the first 10 MB the schema was inferred from)."""
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"text": f"row {i} " + "x" * 170}) + "\n")
        f.write(json.dumps({"text": "last", "source": "web"}) + "\n")
    assert src.stat().st_size > 10 << 20
    texts = _texts(str(src), tmp_path)
    assert len(texts) == 60_001 and texts[0].startswith("row 0 ") and texts[-1] == "last"
    # other keys never matter: types changing from row to row, nesting, keys in one file only
    rows = [
        {"text": "a", "meta": 1},
        {"text": "b", "meta": "one"},
        {"text": "c", "meta": [{}]},
        {"meta": {"x": 1}},
        {"text": 5},
    ]
    write_jsonl(tmp_path / "mixed.jsonl", rows)
    ds = load_text_dataset(str(tmp_path / "mixed.jsonl"), cache_dir=str(tmp_path / "hf"))
    assert ds.column_names == ["text"] and ds["text"] == ["a", "b", "c", None, None]
    with pytest.raises(
        KeyError,
        match=r"\['body'\] not in the dataset; its columns are "
        r"\['text', 'meta'\]",
    ):
        _texts(str(tmp_path / "mixed.jsonl"), tmp_path, keys=["body"])
    # parquet and csv: files whose other columns differ in name and type read as one
    import datasets

    datasets.Dataset.from_list([{"text": "p1", "source": "web"}]).to_parquet(
        str(tmp_path / "1.parquet")
    )
    datasets.Dataset.from_list([{"id": 7, "text": "p2"}]).to_parquet(str(tmp_path / "2.parquet"))
    assert _texts([str(tmp_path / "1.parquet"), str(tmp_path / "2.parquet")], tmp_path) == [
        "p1",
        "p2",
    ]
    (tmp_path / "1.csv").write_text("text,source\nc1,web\n")
    (tmp_path / "2.csv").write_text("id,text,extra\n7,c2,x\n")
    assert _texts([str(tmp_path / "1.csv"), str(tmp_path / "2.csv")], tmp_path) == ["c1", "c2"]


def test_byte_order_mark_is_stripped(tmp_path):
    """Item 15: a .txt starting with a UTF-8 byte-order mark kept it as content."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + b"hello\r\nworld\n")
    (tmp_path / "b.txt").write_bytes(bom + b"second file\n")
    assert _texts([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path) == [
        "hello",
        "world",
        "second file",
    ]
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "j"}\n')
    (tmp_path / "a.csv").write_bytes(bom + b"text\nc\n")
    (tmp_path / "a.json").write_bytes(bom + b' ["s1", "s2"]')
    assert _texts(str(tmp_path / "a.jsonl"), tmp_path) == ["j"]
    assert _texts(str(tmp_path / "a.csv"), tmp_path) == ["c"]
    assert _texts(str(tmp_path / "a.json"), tmp_path) == ["s1", "s2"]
    # a byte-order mark inside the text is content, not a file header
    (tmp_path / "c.txt").write_bytes(b"x\n" + bom + b"y\n")
    assert _texts(str(tmp_path / "c.txt"), tmp_path) == ["x", "\ufeffy"]


def test_cache_follows_the_file(tmp_path):
    """The Arrow copy is reused while the file is unchanged and rebuilt when it changes."""
    src = write_jsonl(tmp_path / "c.jsonl", ["one"])
    assert _texts(str(src), tmp_path) == ["one"]
    write_jsonl(src, ["one", "two"])
    assert _texts(str(src), tmp_path) == ["one", "two"]
    assert len(list((tmp_path / "hf" / "text_files").iterdir())) == 2


def test_command_lines_skip_bad_rows_and_name_empty_files(tmp_path, model, capsys):
    """Both CLIs on the item 12-15 inputs: the bad row skipped and counted, an empty file a
    one-line error naming it, the BOM gone from the tokens."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "hello world"}\n{"text": "bad \xff"}\n{"text": "ok", "x": 1}\n')
    base = ["--cache-dir", str(tmp_path / "hf")]
    with pytest.warns(UserWarning, match="bad.jsonl:2"):
        preprocess_main(
            [
                "--input",
                str(bad),
                "--tokenizer-model",
                str(model),
                "--output-prefix",
                str(tmp_path / "o"),
                "--no-progress",
                *base,
            ]
        )
    assert "2 rows (1 unreadable skipped)" in capsys.readouterr().out
    tok = Tokenizer(model)
    out = IndexedDataset(tmp_path / "o_text_document")
    assert [out[i].tolist() for i in range(len(out))] == tok.encode(["hello world", "ok"])
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello world\n")
    stats = preprocess(
        [str(tmp_path / "bom.txt")],
        tmp_path / "b",
        model,
        cache_dir=str(tmp_path / "hf"),
        progress=False,
    )
    assert stats.keys["text"].documents == 1
    assert (
        IndexedDataset(tmp_path / "b_text_document")[0].tolist() == tok.encode(["hello world"])[0]
    )
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"^no documents in .*empty.jsonl"):
        preprocess(
            [str(tmp_path / "empty.jsonl")],
            tmp_path / "e",
            model,
            cache_dir=str(tmp_path / "hf"),
            progress=False,
        )
    assert not list(tmp_path.glob("e_*"))
    lines = tiny_corpus(tmp_path, 40_000).read_bytes().splitlines(keepends=True)
    corpus = tmp_path / "corpus_bad.jsonl"
    corpus.write_bytes(b"".join(lines[:2]) + b'{"text": "bad \xff"}\n' + b"".join(lines[2:]))
    argv = ["--vocab-size", "600", "--num-threads", "1", *base]
    with pytest.warns(UserWarning, match=r"corpus_bad.jsonl:3: invalid UTF-8 byte 0xff"):
        train_main(["--input", str(corpus), "--model-prefix", str(tmp_path / "t"), *argv])
    assert f"from {len(lines)} documents" in capsys.readouterr().out
    assert Tokenizer(tmp_path / "t.model").vocab_size == 600
    with pytest.raises(SystemExit) as e:
        train_main(["--input", str(tmp_path / "empty.jsonl"), "--model-prefix", str(tmp_path / "u"),
                    *argv])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith("python -m data.train_tokenizer: error: no documents in ")
    assert not (tmp_path / "u.model").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workers", "0"], "--workers 0 must be 1 or more"),
        (
            ["--json-keys", "body"],
            "json key(s) ['body'] not in the dataset; its columns are ['text']",
        ),
        (["--tokenizer-model", "missing.model"], "tokenizer model not found: missing.model"),
    ],
)
def test_preprocess_errors_are_one_line(tmp_path, model, capsys, extra, message):
    """Configuration and input errors of data.preprocess: one line, exit 2, nothing written."""
    src = write_jsonl(tmp_path / "a.jsonl", ["a b"])
    argv = [
        "--input",
        str(src),
        "--tokenizer-model",
        str(model),
        "--output-prefix",
        str(tmp_path / "o"),
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "hf"),
        *extra,
    ]
    with pytest.raises(SystemExit) as e:
        preprocess_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"python -m data.preprocess: error: {message}"]
    assert not list(tmp_path.glob("o*"))
