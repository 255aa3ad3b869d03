"""Train a sentencepiece tokenizer (BPE or unigram) on a corpus: ``python -m data.train_tokenizer``.

Example::

    python -m data.train_tokenizer --input corpus.jsonl --json-keys text \\
        --vocab-size 8000 --model-type bpe --model-prefix runs/tok/spm   # writes runs/tok/spm.model

The model is built so that any text round-trips exactly (with :class:`data.tokenizer.Tokenizer`):
byte fallback (on by default: a character outside the vocabulary becomes its UTF-8 bytes, never
``<unk>``), no Unicode normalisation, whitespace kept as it is, and sentencepiece's whitespace
symbol ``▁`` (U+2581, which every space becomes) always in the vocabulary, whatever the corpus:
without it a corpus with no spaces (CJK, say) gave a model that byte-encodes a space as the
three bytes of ``▁`` and decodes it as ``▁``. Digits are split one per token.

sentencepiece reads *sentences*: documents are cut at newlines, and a line longer than its
``max_sentence_length`` (bytes), which sentencepiece would silently drop, is cut into pieces
at whitespace where possible; the number of cut lines is reported. For a large corpus
``--input-sentence-size`` samples that many lines (sentencepiece's reservoir sampling) and
``--max-documents`` stops reading early.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from data.text_source import add_input_args, exit_with_error, iter_texts, load_text_dataset

CONTROL_PIECES = ("<unk>", "<s>", "</s>", "<pad>")
MAX_SENTENCE_BYTES = 4192  # sentencepiece's default max_sentence_length
WHITESPACE_PIECE = "\u2581"  # sentencepiece's escaped space: must be a piece, see module doc


def validate_special_ids(
    vocab_size: int,
    unk_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    user_defined_symbols: list[str],
    byte_fallback: bool,
) -> None:
    """Check special ids and symbols before training starts.

    ``unk_id`` is required; bos/eos/pad may be -1 (disabled). Ids must be distinct and below
    ``vocab_size``, and the vocabulary must have room for specials, user symbols, the 256
    byte pieces of byte fallback and the whitespace piece.

    Raises:
        ValueError: naming every colliding pair, the out-of-range id or the duplicated symbol.
    """
    ids = {"unk_id": unk_id, "bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id}
    if unk_id < 0:
        raise ValueError("unk_id must be >= 0: sentencepiece always needs an <unk> piece")
    errors = []
    for name, i in ids.items():
        if i < -1 or i >= vocab_size:
            errors.append(
                f"{name}={i} is outside [0, vocab_size) = [0, {vocab_size}) (-1 disables)"
            )
    names = list(ids)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            if ids[names[a]] >= 0 and ids[names[a]] == ids[names[b]]:
                errors.append(
                    f"{names[a]}={ids[names[a]]} collides with {names[b]}={ids[names[b]]}"
                )
    seen = set()
    for s in user_defined_symbols:
        if not s:
            errors.append("an empty user-defined symbol")
        elif s in seen:
            errors.append(f"user-defined symbol {s!r} is given twice")
        elif s in CONTROL_PIECES:
            errors.append(f"user-defined symbol {s!r} is a reserved special piece")
        seen.add(s)
    needed = (
        sum(i >= 0 for i in ids.values())
        + len(user_defined_symbols)
        + (256 if byte_fallback else 0)
        + 1  # the whitespace piece
    )
    if vocab_size <= needed:
        errors.append(
            f"vocab_size={vocab_size} leaves no room for learned pieces after {needed} "
            f"special, user-defined and byte-fallback pieces: give {needed + 1} or more"
        )
    if errors:
        raise ValueError("invalid tokenizer specials: " + "; ".join(errors))


def split_long_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> list[str]:
    """Cut ``line`` into pieces of at most ``max_bytes`` UTF-8 bytes, at whitespace if possible.

    Never splits a character; pieces joined back give ``line``.
    """
    raw = line.encode("utf-8")
    if len(raw) <= max_bytes:
        return [line]
    out = []
    while len(raw) > max_bytes:
        cut = max_bytes
        while cut > 0 and (raw[cut] & 0xC0) == 0x80:  # do not cut inside a UTF-8 sequence
            cut -= 1
        space = raw.rfind(b" ", max_bytes // 2, cut)
        if space > 0:
            cut = space
        out.append(raw[:cut].decode("utf-8"))
        raw = raw[cut:]
    out.append(raw.decode("utf-8"))
    return out


@dataclass
class SentenceStats:
    """What :func:`iter_sentences` saw (filled while iterating)."""

    documents: int = 0
    sentences: int = 0
    long_lines_split: int = 0


def iter_sentences(
    texts: Iterable[str],
    stats: SentenceStats,
    max_bytes: int = MAX_SENTENCE_BYTES,
    max_documents: int | None = None,
) -> Iterator[str]:
    """Non-blank lines of each text, long ones split (counted in ``stats``)."""
    for text in texts:
        if max_documents is not None and stats.documents >= max_documents:
            return
        stats.documents += 1
        for line in text.split("\n"):
            if not line.strip():
                continue
            parts = split_long_line(line, max_bytes)
            stats.long_lines_split += len(parts) > 1
            stats.sentences += len(parts)
            yield from parts


def train_tokenizer(
    texts: Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    byte_fallback: bool = True,
    user_defined_symbols: list[str] | None = None,
    unk_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 3,
    character_coverage: float = 0.9995,
    input_sentence_size: int = 2_000_000,
    max_documents: int | None = None,
    num_threads: int = 1,
) -> SentenceStats:
    """Train and write ``<model_prefix>.model`` (and ``.vocab``); return what was read.

    Args:
        texts: documents (any iterable of strings).
        vocab_size: total ids including specials and byte pieces.
        model_type: ``"bpe"`` or ``"unigram"``.
        input_sentence_size: lines sampled for training (0: all).
        max_documents: stop reading after this many documents (None: all).

    Raises:
        ValueError: bad specials (see :func:`validate_special_ids`), an unknown model type, or
            a corpus with no text; sentencepiece's own error (vocabulary too large for the
            corpus, say) is re-raised as ValueError with the setting named.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    symbols = list(user_defined_symbols or [])
    validate_special_ids(vocab_size, unk_id, bos_id, eos_id, pad_id, symbols, byte_fallback)
    stats = SentenceStats()
    proto = _train_model_proto(
        iter_sentences(texts, stats, MAX_SENTENCE_BYTES, max_documents), stats,
        vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
        user_defined_symbols=symbols, unk_id=unk_id, bos_id=bos_id, eos_id=eos_id,
        pad_id=pad_id, character_coverage=character_coverage,
        input_sentence_size=input_sentence_size, num_threads=num_threads,
    )
    _write_model(proto, model_prefix)
    return stats


def _train_model_proto(sentences: Iterator[str], stats: SentenceStats, **options) -> bytes:
    """The serialized model sentencepiece trains on ``sentences`` with ``options`` (the
    caller's settings) and this module's fixed ones (exact round trips, see the module doc).

    Raises:
        ValueError: no text at all, or sentencepiece's error in the caller's terms.
    """
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=sentences,
            model_writer=proto,
            **options,
            shuffle_input_sentence=True, max_sentence_length=MAX_SENTENCE_BYTES,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
            required_chars=WHITESPACE_PIECE, minloglevel=2,
        )
    except RuntimeError as e:
        if stats.sentences == 0:
            raise ValueError(
                "no text to train the tokenizer on (every document empty or skipped)"
            ) from e
        raise ValueError(_training_error(str(e), options["vocab_size"], options["model_type"],
                                         options["character_coverage"], stats)) from e
    return proto.getvalue()


def _write_model(proto: bytes, model_prefix: str | os.PathLike) -> None:
    """``<prefix>.model`` (written under a temporary name, then renamed) and ``<prefix>.vocab``
    (one ``piece<TAB>score`` line per id)."""
    prefix = Path(os.fspath(model_prefix))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{prefix}.model.tmp{os.getpid()}")
    tmp.write_bytes(proto)
    os.replace(tmp, f"{prefix}.model")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    with open(f"{prefix}.vocab", "w", encoding="utf-8") as f:
        for i in range(sp.GetPieceSize()):
            f.write(f"{sp.IdToPiece(i)}\t{sp.GetScore(i)}\n")


SPECIAL_DEFAULTS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
_FLAG_NAMES = (*SPECIAL_DEFAULTS, "vocab_size", "character_coverage", "model_type")


def as_flags(message: str) -> str:
    """``"bos_id=1"`` -> ``"--bos-id 1"`` in ``message``: the spelling a command-line user knows."""
    for name in _FLAG_NAMES:
        message = re.sub(
            rf"\b{name}=([-\w.]+)", lambda m, n=name: f"--{n.replace('_', '-')} {m[1]}", message
        )
    return message


def check_args(a: argparse.Namespace) -> None:
    """Every configuration error of the command line at once, before the corpus is read.

    Raises:
        ValueError: one line naming each bad flag with its value (and, for colliding special
            ids, which of them are defaults and how to move or disable one).
    """
    errors = []
    for flag, value, ok, want in (
        ("--vocab-size", a.vocab_size, a.vocab_size > 0, "> 0"),
        ("--character-coverage", a.character_coverage, 0 < a.character_coverage <= 1, "in (0, 1]"),
        ("--input-sentence-size", a.input_sentence_size, a.input_sentence_size >= 0, ">= 0"),
        ("--max-documents", a.max_documents, a.max_documents is None or a.max_documents > 0, "> 0"),
        ("--num-threads", a.num_threads, a.num_threads > 0, "> 0"),
    ):
        if not ok:
            errors.append(f"{flag} {value} must be {want}")
    try:
        validate_special_ids(
            a.vocab_size,
            a.unk_id,
            a.bos_id,
            a.eos_id,
            a.pad_id,
            a.user_defined_symbols,
            a.byte_fallback,
        )
    except ValueError as e:
        msg = as_flags(str(e))
        defaults = [
            f"--{n.replace('_', '-')} {v}"
            for n, v in SPECIAL_DEFAULTS.items()
            if getattr(a, n) == v
        ]
        if "collides" in msg and defaults:
            msg += (
                f" ({', '.join(defaults)} by default; give the colliding one another free id, "
                "or -1 to disable --bos-id/--eos-id/--pad-id)"
            )
        errors.append(msg.removeprefix("invalid tokenizer specials: "))
    if errors:
        raise ValueError("; ".join(errors))


def _training_error(
    error: str, vocab_size: int, model_type: str, coverage: float, stats: SentenceStats
) -> str:
    """sentencepiece's two vocabulary-size failures in the caller's terms, others as they are."""
    read = f"{stats.documents} documents, {stats.sentences} lines"
    if m := re.search(
        r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", error
    ):
        return (
            f"vocab_size={vocab_size} is more than this corpus gives ({read}): at most {m[2]} "
            f"with model_type={model_type}; lower it or give more text"
        )
    if m := re.search(r"smaller than required_chars\. (\d+) vs (\d+)", error):
        return (
            f"vocab_size={vocab_size} is below the {m[2]} pieces that the specials, byte pieces "
            f"and the characters covering character_coverage={coverage} need ({read}); raise "
            "it, or lower character_coverage so that rare characters fall back to bytes"
        )
    return (f"sentencepiece training failed (vocab_size={vocab_size}, model_type={model_type}, "
            f"{read}): {error}")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (input flags from :func:`data.text_source.add_input_args`)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m data.train_tokenizer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_input_args(p, "text column(s)")
    p.add_argument("--vocab-size", type=int, default=32000, help="ids, specials and bytes included")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="algorithm")
    p.add_argument("--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument(
        "--byte-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="unknown characters become UTF-8 byte pieces (needed for exact round trips)",
    )
    p.add_argument("--user-defined-symbols", nargs="*", default=[], help="extra special tokens")
    p.add_argument("--unk-id", type=int, default=0, help="id of <unk> (required)")
    p.add_argument("--bos-id", type=int, default=1, help="id of <s>; -1 disables")
    p.add_argument(
        "--eos-id", type=int, default=2, help="id of </s>, also the end of document; -1 disables"
    )
    p.add_argument("--pad-id", type=int, default=3, help="id of <pad>; -1 disables")
    p.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters in the alphabet; the rest fall back to bytes",
    )
    p.add_argument(
        "--input-sentence-size", type=int, default=2_000_000, help="lines sampled; 0 = all"
    )
    p.add_argument(
        "--max-documents", type=int, default=None, help="read at most this many documents"
    )
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="trainer threads")
    p.add_argument("--cache-dir", default=None, help="datasets cache directory")
    return p


def main(argv: list[str] | None = None) -> None:
    """Command line; a configuration or input error exits with status 2 and one line."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        check_args(a)  # before the (possibly long) corpus load
        ds = load_text_dataset(a.input, keys=a.json_keys, config=a.dataset_config,
                               split=a.split, cache_dir=a.cache_dir)
        t0 = time.perf_counter()
        stats = train_tokenizer(
            iter_texts(ds, a.json_keys), a.model_prefix, a.vocab_size, a.model_type,
            a.byte_fallback, a.user_defined_symbols, a.unk_id, a.bos_id, a.eos_id, a.pad_id,
            a.character_coverage, a.input_sentence_size, a.max_documents, a.num_threads,
        )
    except (ValueError, FileNotFoundError) as e:
        exit_with_error(p.prog, as_flags(str(e)))
    except KeyError as e:
        exit_with_error(p.prog, e.args[0])
    print(
        f"trained {a.model_type} tokenizer, vocab {a.vocab_size}, from {stats.documents} "
        f"documents / {stats.sentences} lines in {time.perf_counter() - t0:.1f} s; "
        f"{stats.long_lines_split} lines longer than {MAX_SENTENCE_BYTES} bytes were split; "
        f"wrote {a.model_prefix}.model"
    )


if __name__ == "__main__":
    main()
