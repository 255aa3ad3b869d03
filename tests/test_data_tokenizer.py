"""Tokenizer training and the Tokenizer wrapper."""

from __future__ import annotations

import pytest
from data_helpers import TINY_VOCAB, tiny_corpus, tiny_tokenizer

from data.tokenizer import Tokenizer
from data.train_tokenizer import (
    SentenceStats,
    iter_sentences,
    main,
    split_long_line,
    train_tokenizer,
    validate_special_ids,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize(
    "text",
    [
        "é😀 ok",
        "汉字と仮名、한국어",
        "e\u0301 a\u0308\u0323 n\u0303",
        "🧑‍🤝‍🧑 family",
        "  two  spaces\n\nand\ttabs ",
        "",
        "\x00\x7f control",
        "<|sep|> user symbol",
    ],
)
def test_byte_fallback_round_trips(tok, text):
    (ids,) = tok.encode([text])
    assert tok.decode(ids) == text
    assert tok.unk not in ids  # byte fallback, never <unk>


def test_wrapper_ids_and_batches(tok):
    assert tok.vocab_size == TINY_VOCAB
    assert (tok.unk, tok.bos, tok.eod, tok.pad) == (0, 1, 2, 3)
    batch = tok.encode(["hello world", "x"])
    assert tok.decode(batch) == ["hello world", "x"]
    assert len(tok.encode(["<|sep|>"])[0]) == 1  # a user-defined symbol is one token
    with pytest.raises(TypeError):
        tok.encode("not a list")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"pad_id": 0}, ["unk_id=0 collides with pad_id=0"]),
        (
            {"bos_id": 2, "pad_id": 2},
            ["bos_id=2 collides with eos_id=2", "bos_id=2 collides with pad_id=2"],
        ),
        ({"eos_id": 900}, ["eos_id=900 is outside"]),
        ({"symbols": ["<s>"]}, ["'<s>' is a reserved"]),
        ({"symbols": ["a", "a"]}, ["'a' is given twice"]),
        ({"vocab_size": 260}, ["leaves no room"]),
    ],
)
def test_special_ids_are_validated(kwargs, words):
    args = {
        "vocab_size": 600,
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": 3,
        "symbols": [],
        "byte_fallback": True,
    } | kwargs
    symbols = args.pop("symbols")
    with pytest.raises(ValueError) as e:
        validate_special_ids(user_defined_symbols=symbols, **args)
    for w in words:
        assert w in str(e.value)


def test_long_lines_are_split_not_dropped():
    line = ("wörd " * 2000).strip()  # 12k bytes
    parts = split_long_line(line, 4192)
    assert (
        "".join(parts) == line and all(len(p.encode()) <= 4192 for p in parts) and len(parts) == 3
    )
    emoji = "😀" * 2000  # no spaces, 4-byte characters: cut between characters
    assert "".join(split_long_line(emoji, 4190)) == emoji
    stats = SentenceStats()
    out = list(iter_sentences(["short\n\n" + line, "   "], stats))
    assert stats.long_lines_split == 1 and stats.sentences == len(out) == 4 and stats.documents == 2


def test_unigram_and_cli(tmp_path, capsys):
    corpus = tiny_corpus(tmp_path)
    main(
        [
            "--input",
            str(corpus),
            "--vocab-size",
            "500",
            "--model-type",
            "unigram",
            "--model-prefix",
            str(tmp_path / "uni"),
            "--num-threads",
            "1",
        ]
    )
    assert "lines longer than 4192 bytes were split" in capsys.readouterr().out
    tok = Tokenizer(tmp_path / "uni.model")
    assert tok.vocab_size == 500 and tok.decode(tok.encode(["ünïcode 😀"])) == ["ünïcode 😀"]
    with pytest.raises(ValueError, match="unk_id=0 collides with pad_id=0"):
        main(["--input", str(corpus), "--pad-id", "0", "--model-prefix", str(tmp_path / "bad")])
    assert not (tmp_path / "bad.model").exists()


def test_empty_corpus_and_bad_model_files(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer(["", "  \n "], tmp_path / "t", 300)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read sentencepiece model"):
        Tokenizer(tmp_path / "junk.model")
