"""Which strings round-trip through :class:`data.tokenizer.Tokenizer`, U+2581 (``▁``,
sentencepiece's space symbol) above all: every string with a ``data.train_tokenizer`` model,
even one trained on text without spaces; the strings docs/training.md names, with the value
they come back as, for models from elsewhere (exact string comparisons)."""

from __future__ import annotations

import random
import warnings

import pytest
import sentencepiece as spm

from data.tokenizer import Tokenizer
from data.train_tokenizer import train_tokenizer

WS = "\u2581"
STRINGS = [f" {WS} ", WS, f"a{WS}b", f" {WS}", f"{WS} ", WS * 2, f"  {WS}  ", f"a {WS} b",
           f"{WS}a", f"x{WS}", "a b", " ", f"\u2582{WS}\u2583 汉字 😀"]


@pytest.fixture(scope="module")
def no_space_texts():
    rng = random.Random(0)
    return ["".join(rng.choice("abcdefgh汉字") for _ in range(200)) for _ in range(200)]


def test_every_string_round_trips_with_our_trainer_on_text_without_spaces(tmp_path,
                                                                           no_space_texts):
    train_tokenizer(no_space_texts, tmp_path / "nospace", 300)
    tok = Tokenizer(tmp_path / "nospace.model")
    for s in STRINGS:
        assert tok.decode(tok.encode([s])[0]) == s, s


def _foreign(tmp_path, texts, name, **kw) -> Tokenizer:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(tmp_path / name), model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = Tokenizer(tmp_path / f"{name}.model")
    tok.warnings = [str(w.message) for w in caught]
    return tok


def test_the_strings_docs_name_do_not_round_trip_with_foreign_models(tmp_path, no_space_texts):
    # no whitespace piece (sentencepiece's own trainer on text without spaces): spaces -> ▁
    nows = _foreign(tmp_path, no_space_texts, "nows", vocab_size=300, byte_fallback=True,
                    add_dummy_prefix=False)
    assert any("decodes a space as U+2581" in w for w in nows.warnings)
    assert nows.decode(nows.encode([f" {WS} "])[0]) == WS * 3
    assert nows.decode(nows.encode(["a b"])[0]) == f"a{WS}b"
    assert nows.decode(nows.encode([f"a{WS}b"])[0]) == f"a{WS}b"  # no space: still exact
    # a dummy prefix (Llama 2's setting) or no byte pieces: a literal ▁ comes back as a space
    for name, kw in (("dummy", dict(vocab_size=300, byte_fallback=True, add_dummy_prefix=True)),
                     ("nobytes", dict(vocab_size=40, byte_fallback=False,
                                      add_dummy_prefix=False))):
        tok = _foreign(tmp_path, no_space_texts, name, user_defined_symbols=[WS], **kw)
        assert not tok.warnings
        assert tok.decode(tok.encode([f"a{WS}b"])[0]) == "a b", name
        assert tok.decode(tok.encode([f" {WS} "])[0]) == "   ", name
        assert tok.decode(tok.encode(["a b"])[0]) == "a b", name
