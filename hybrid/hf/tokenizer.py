"""Our sentencepiece model as a Hugging Face ``tokenizers`` tokenizer that encodes and decodes
identically: ``AutoTokenizer.from_pretrained(HF_DIR)`` then gives the ids of
:class:`data.tokenizer.Tokenizer`.

The sentencepiece model proto is translated piece for piece (same ids):

- BPE: every split of a normal piece into two vocabulary pieces becomes a merge, ranked by the
  merged piece's score, which is the order in which sentencepiece's BPE encoder applies them
  (highest score first); unigram: the same pieces and scores (Viterbi in both libraries).
- spaces become the whitespace symbol with nothing prepended (our models have no dummy
  prefix), unknown characters become their UTF-8 byte pieces (byte fallback), and decoding
  reverses both. The exported vocabulary spells the whitespace symbol U+FFFF (a Unicode
  noncharacter) rather than sentencepiece's ``▁`` (U+2581), so that a ``▁`` in the text is
  encoded as its bytes, as :class:`data.tokenizer.Tokenizer` does; the one text it reads
  differently is one holding U+FFFF itself, which it takes for a space.
- control pieces (``<unk> <s> </s> <pad>``) are special tokens, but text that spells them is
  encoded as text (``split_special_tokens``), as sentencepiece does; user-defined symbols are
  always one token, as in sentencepiece.

Models that normalise text (NFKC rules, a dummy prefix, collapsing whitespace) are refused:
this translation does not reproduce them.
"""

from __future__ import annotations

import os
from pathlib import Path

# sentencepiece ModelProto.SentencePiece.Type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE, _UNIGRAM = 2, 1
_NEVER = -1e9
_WS = "\u2581"  # sentencepiece's whitespace symbol
_SPACE = "\uffff"  # a Unicode noncharacter: what a space becomes in the exported vocabulary


def _read_proto(model_path: str | os.PathLike):
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto()
    try:
        m.ParseFromString(Path(model_path).read_bytes())
    except Exception as e:  # protobuf's DecodeError has no stable import path
        raise ValueError(f"cannot read sentencepiece model {model_path}: {e}") from e
    return m


def _check_normalization(m, model_path) -> None:
    ns, ts = m.normalizer_spec, m.trainer_spec
    problems = []
    if ns.precompiled_charsmap or ns.name not in ("identity", ""):
        problems.append(f"normalization_rule_name={ns.name!r} (only 'identity' is translated)")
    if ns.add_dummy_prefix:
        problems.append("add_dummy_prefix=True")
    if ns.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=True")
    if not ns.escape_whitespaces:
        problems.append("escape_whitespaces=False")
    if ts.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix=True")
    if ts.model_type not in (_BPE, _UNIGRAM):
        problems.append(f"model_type={ts.model_type} (only bpe and unigram)")
    if problems:
        raise ValueError(f"sentencepiece model {model_path} cannot be exported exactly: "
                         + "; ".join(problems) + " (models from data.train_tokenizer can)")


def _bpe_merges(pieces, names: list[str]) -> list[tuple[str, str]]:
    """All ``(left, right)`` with ``left + right`` a normal piece and both halves normal
    pieces, highest merged score first (``names``: the pieces as the HF vocabulary spells them)."""
    vocab = {n: i for i, n in enumerate(names)}
    usable = {n for n, p in zip(names, pieces, strict=True) if p.type == _NORMAL}
    ranked = []
    for i, (name, p) in enumerate(zip(names, pieces, strict=True)):
        if p.type != _NORMAL or len(name) < 2:
            continue
        for cut in range(1, len(name)):
            left, right = name[:cut], name[cut:]
            if left in usable and right in usable:
                ranked.append((-p.score, i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(model_path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` equivalent to the sentencepiece model at ``model_path``.

    Returns:
        ``(tokenizer, specials)``: the tokenizer and ``{"unk"|"bos"|"eos"|"pad": piece}`` for
        the special ids the model defines.

    Raises:
        ValueError: unreadable model, or a normalisation this translation does not reproduce
            (the message names the setting).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE, Unigram

    m = _read_proto(model_path)
    _check_normalization(m, model_path)
    pieces, ts = m.pieces, m.trainer_spec
    # data.tokenizer.Tokenizer encodes a literal U+2581 in the text as its byte pieces when the
    # model has a whitespace piece and byte fallback; for the same ids here, spaces map to a
    # noncharacter instead, so that a literal U+2581 is out of vocabulary and falls back to bytes.
    space = _SPACE if ts.byte_fallback and any(p.piece == _WS for p in pieces) else _WS
    names = [p.piece.replace(_WS, space) for p in pieces]
    unk = names[ts.unk_id]
    if ts.model_type == _BPE:
        model = BPE(vocab={n: i for i, n in enumerate(names)}, merges=_bpe_merges(pieces, names),
                    unk_token=unk, fuse_unk=True, byte_fallback=ts.byte_fallback)
    else:
        # sentencepiece's lattice holds only normal and user-defined pieces; the others get a
        # score no segmentation of real text would choose (a spelled-out "</s>" stays text).
        model = Unigram([(n, p.score if p.type in (_NORMAL, _USER_DEFINED) else _NEVER)
                         for n, p in zip(names, pieces, strict=True)], unk_id=ts.unk_id,
                        byte_fallback=ts.byte_fallback)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", space)
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_tokens([AddedToken(n, special=False, normalized=False)
                    for n, p in zip(names, pieces, strict=True) if p.type == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False)
                            for n, p in zip(names, pieces, strict=True)
                            if p.type in (_CONTROL, _UNKNOWN)])
    specials = {"unk": unk}
    for key, i in (("bos", ts.bos_id), ("eos", ts.eos_id), ("pad", ts.pad_id)):
        if 0 <= i < len(pieces):
            specials[key] = names[i]
    return tok, specials


def save_tokenizer(model_path: str | os.PathLike, output_dir: str | os.PathLike) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer`` into
    ``output_dir``; no bos/eos are added on encode (as :class:`data.tokenizer.Tokenizer`).

    Returns:
        ``{"bos_token_id"|"eos_token_id"|"pad_token_id": id}`` for the ids the model defines
        (for the model's ``config.json``).
    """
    from transformers import PreTrainedTokenizerFast

    tok, specials = build_tokenizer(model_path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, split_special_tokens=True, clean_up_tokenization_spaces=False,
        add_bos_token=False, add_eos_token=False, model_max_length=int(1e30),
        **{f"{k}_token": v for k, v in specials.items()})
    fast.save_pretrained(str(output_dir))
    return {f"{k}_token_id": tok.token_to_id(v) for k, v in specials.items() if k != "unk"}
