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
    with pytest.raises(SystemExit):
        main(["--input", str(corpus), "--pad-id", "0", "--model-prefix", str(tmp_path / "bad")])
    assert "--unk-id 0 collides with --pad-id 0" in capsys.readouterr().err
    assert not (tmp_path / "bad.model").exists()


def test_empty_corpus_and_bad_model_files(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer(["", "  \n "], tmp_path / "t", 300)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read sentencepiece model"):
        Tokenizer(tmp_path / "junk.model")


def _random_strings(n: int, seed: int) -> list[str]:
    """Strings that break tokenizers: every kind of space and line break, in runs and at both
    ends; emoji with joiners and modifiers; CJK; combining marks; controls; sentencepiece's own
    whitespace symbol and piece spellings; and code points drawn from the whole of Unicode."""
    import random

    rng = random.Random(seed)
    pools = [
        " ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\u200b", "\ufeff",
        "\u2581", "\u2581\u2581", "<s>", "</s>", "<unk>", "<pad>", "<0x41>", "<|sep|>",
        "😀", "🧑\u200d🤝\u200d🧑", "👍🏽", "🇯🇵", "汉字", "仮名", "한국어", "ﾊﾝｶｸ",
        "e\u0301", "a\u0308\u0323", "\u0915\u094d\u0937", "\u0627\u0644\u0639", "Ω", "ﬁ",
        "\x00", "\x07", "\x7f", "\u0085", "\u2028", "0", "123", "word", "Word", ".", "'",
    ]  # fmt: skip
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.2:
                cp = rng.randint(1, 0x10FFFF)
                if not 0xD800 <= cp <= 0xDFFF:  # surrogates are not text
                    parts.append(chr(cp))
            else:
                parts.append(rng.choice(pools))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_any_string_round_trips_with_any_corpus(tmp_path, model_type):
    """Issue 13 item 16: trained on text without spaces (CJK only, vocab 300), 'a b' was
    encoded as the bytes of '▁' and decoded 'a▁b'. Right: decode(encode(s)) == s for any s,
    whatever the corpus (here: no spaces; and the English corpus)."""
    import random

    rng = random.Random(0)
    cjk = ["".join(chr(0x4E00 + rng.randrange(20)) for _ in range(40)) for _ in range(300)]
    train_tokenizer(cjk, tmp_path / "cjk", 300, model_type=model_type)
    cjk_tok = Tokenizer(tmp_path / "cjk.model")
    (ids,) = cjk_tok.encode(["a b"])
    assert cjk_tok.decode(ids) == "a b" and cjk_tok.id_to_piece(ids[1]) == "\u2581"
    strings = _random_strings(1500, seed=1) + [
        " ",
        "   ",
        " lead",
        "trail  ",
        "a  b   c",
        "\u2581",
        " \u2581 ",
        "a\u2581b c",
        "x\u2581",
    ]
    corpus = tiny_corpus(tmp_path, 60_000).read_text(encoding="utf-8").splitlines()
    import json

    train_tokenizer(
        [json.loads(x)["text"] for x in corpus], tmp_path / "en", 400, model_type=model_type
    )
    for tok in (cjk_tok, Tokenizer(tmp_path / "en.model")):
        ids = tok.encode(strings)
        bad = [s for s, i in zip(strings, ids, strict=True) if tok.decode(i) != s]
        assert bad == [], f"{tok}: {bad[:5]}"
        assert all(tok.unk not in i for i in ids)  # byte fallback, never <unk>


def test_old_models_without_the_whitespace_piece_warn(tmp_path):
    """A model trained before the fix (no '▁' piece) is named on load, not silently used."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(["一二三四五六七八九十"] * 50),
        model_prefix=str(tmp_path / "old"),
        vocab_size=270,
        byte_fallback=True,
        add_dummy_prefix=False,
        minloglevel=2,
    )
    with pytest.warns(
        UserWarning, match=r"decodes a space as U\+2581 \('a▁b' for 'a b'\)"
    ):
        Tokenizer(tmp_path / "old.model")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--pad-id", "0", "--eos-id", "1", "--unk-id", "2"],
            "--bos-id 1 collides with --eos-id 1 (--bos-id 1 by default; give the colliding one "
            "another free id, or -1 to disable --bos-id/--eos-id/--pad-id)",
        ),
        (["--pad-id", "0"], "--unk-id 0 collides with --pad-id 0"),
        (["--vocab-size", "100"], "--vocab-size 100 leaves no room"),
        (["--character-coverage", "0"], "--character-coverage 0.0 must be in (0, 1]"),
        (
            ["--max-documents", "0", "--num-threads", "0"],
            "--max-documents 0 must be > 0; --num-threads 0 must be > 0",
        ),
        (["--eos-id", "40000"], "--eos-id 40000 is outside [0, vocab_size) = [0, 32000)"),
        ([], "input file not found: "),  # no configuration error: the input is checked next
    ],
)
def test_cli_configuration_errors_are_one_line(tmp_path, capsys, argv, message):
    """Issue 13 item 17: '--pad-id 0 --eos-id 1 --unk-id 2' (colliding with the default BOS id
    1) came out as a traceback. Right: one line naming the flags, before any work (the input
    file does not even exist here, and is not what is reported)."""
    with pytest.raises(SystemExit) as e:
        main(["--input", str(tmp_path / "missing.jsonl"), "--model-prefix", str(tmp_path / "t"),
              *argv])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1]
    assert len(err) == 1 and err[0].startswith("python -m data.train_tokenizer: error: ")
    assert not list(tmp_path.iterdir())


def test_vocabulary_size_errors_say_what_to_change(tmp_path, capsys):
    """sentencepiece's own vocabulary-size failures, in the caller's terms: 4 specials + 256
    bytes + the whitespace piece + 10 digits = 271 pieces is all a digits-only corpus gives;
    50 distinct CJK characters need 311 pieces."""
    with pytest.raises(ValueError) as e:
        train_tokenizer(["0123456789" * 3] * 300, tmp_path / "d", 300)
    assert str(e.value) == (
        "vocab_size=300 is more than this corpus gives (300 documents, 300 lines): at most 271 "
        "with model_type=bpe; lower it or give more text"
    )
    cjk = ["".join(chr(0x4E00 + (i * 7 + j) % 50) for j in range(60)) for i in range(200)]
    with pytest.raises(ValueError, match=r"^vocab_size=300 is below the 311 pieces that the "):
        train_tokenizer(cjk, tmp_path / "c", 300, model_type="unigram", character_coverage=1.0)
    corpus = tmp_path / "digits.txt"
    corpus.write_text("0123456789\n" * 50)
    with pytest.raises(SystemExit):
        main(["--input", str(corpus), "--vocab-size", "300", "--model-prefix", str(tmp_path / "t"),
              "--cache-dir", str(tmp_path / "hf"), "--num-threads", "1"])  # fmt: skip
    assert capsys.readouterr().err == (
        "python -m data.train_tokenizer: error: --vocab-size 300 is more than this corpus gives "
        "(50 documents, 50 lines): at most 271 with --model-type bpe; lower it or give more text\n"
    )
    assert not (tmp_path / "t.model").exists()
