"""The tokenizer every part of the project uses: a thin wrapper over a sentencepiece model.

Models trained by :mod:`data.train_tokenizer` use byte fallback, no normalisation and always
hold the whitespace piece ``▁``, so ``decode(encode(s)) == s`` for any string (emoji, CJK,
combining marks, runs of spaces, newlines), whatever corpus trained them. sentencepiece turns
every space into ``▁`` (U+2581) before encoding, so a ``▁`` in the text itself would come back
as a space; this wrapper encodes such a character as its three UTF-8 byte pieces, which decode
to ``▁``. Models from elsewhere (Llama's, say) load too; their own round-trip rules apply, and a
model that cannot give back a space gets a warning at load.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import sentencepiece as spm

_WS = "\u2581"  # sentencepiece's whitespace symbol


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")
"""``--tokenizer-type`` values with a ``--tokenizer-model`` (Megatron-LM's names)."""
SENTENCEPIECE_ALIASES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer")
"""Megatron-LM's other sentencepiece types: the same tokenizer here (no ids added)."""


def infer_tokenizer_type(model_path: str | os.PathLike) -> str:
    """``HuggingFaceTokenizer`` for a directory or a ``.json`` file, else
    ``SentencePieceTokenizer`` (a ``.model`` file)."""
    p = Path(model_path)
    return "HuggingFaceTokenizer" if p.is_dir() or p.suffix == ".json" else "SentencePieceTokenizer"


def load_tokenizer(model_path: str | os.PathLike, tokenizer_type: str | None = None):
    """The tokenizer of ``--tokenizer-model`` (``--tokenizer-type``; None: inferred by
    :func:`infer_tokenizer_type`): :class:`Tokenizer`, :class:`data.hf_tokenizer.HFTokenizer` or,
    for ``GPT2BPETokenizer`` with ``model_path = (vocab file, merge file)``,
    :class:`data.gpt2_bpe.GPT2BPETokenizer`,
    which share ``encode``, ``decode``, ``eod``, ``bos``, ``adds_bos`` and ``vocab_size``.

    Raises:
        ValueError: an unknown type (the valid ones named) or an unreadable model.
        FileNotFoundError: the file or directory is missing.
    """
    if tokenizer_type == "GPT2BPETokenizer":  # model_path: (vocab file, merge file)
        from data.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(model_path)
    kind = tokenizer_type or infer_tokenizer_type(model_path)
    if kind in SENTENCEPIECE_ALIASES:
        kind = "SentencePieceTokenizer"
    if kind == "SentencePieceTokenizer":
        if Path(model_path).is_dir():
            raise ValueError(f"--tokenizer-model {model_path} is a directory; "
                             "--tokenizer-type SentencePieceTokenizer needs a .model file (a "
                             "directory with tokenizer.json: HuggingFaceTokenizer)")
        return Tokenizer(model_path)
    if kind == "HuggingFaceTokenizer":
        from data.hf_tokenizer import HFTokenizer

        return HFTokenizer(model_path)
    raise ValueError(f"--tokenizer-type {kind}: valid with --tokenizer-model are "
                     f"{', '.join(TOKENIZER_TYPES + SENTENCEPIECE_ALIASES)}")


class Tokenizer:
    """A sentencepiece model with the ids a GPT pipeline needs.

    Args:
        model_path: a ``.model`` file.

    Attributes:
        vocab_size: number of ids, ``0 .. vocab_size - 1`` (the model's embedding needs at
            least this many rows).
        bos, pad, unk: special ids, -1 when the model has none.
        adds_bos: always False: :meth:`encode` adds no id (Megatron-LM's sentencepiece
            tokenizers neither).
        model_path: the path it was loaded from.

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: the file is not a readable sentencepiece model.

    Warns:
        UserWarning: the model decodes a space as U+2581 (a model trained, before the
            whitespace piece was required, on a corpus without spaces).
    """

    kind = "SentencePieceTokenizer"
    adds_bos = False

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = os.fspath(model_path)
        if not Path(self.model_path).is_file():
            raise FileNotFoundError(f"tokenizer model not found: {self.model_path}")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(self.model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"cannot read sentencepiece model {self.model_path}: {e}") from e
        self._sp = sp
        self.vocab_size: int = sp.GetPieceSize()
        self.bos: int = sp.bos_id()
        self.pad: int = sp.pad_id()
        self.unk: int = sp.unk_id()
        self._eos: int = sp.eos_id()
        self._literal_ws = self._literal_whitespace_ids()
        decoded = sp.Decode(sp.Encode("a b"))
        if _WS in decoded:  # the space came back as the escape symbol: silent corruption
            warnings.warn(
                f"tokenizer {self.model_path} decodes a space as U+2581 ({decoded!r} for "
                "'a b'): it has no whitespace piece; retrain it with data.train_tokenizer, "
                "whose models always hold one",
                stacklevel=2,
            )

    def _literal_whitespace_ids(self) -> list[int] | None:
        """Byte-piece ids of a literal U+2581 when the model confuses it with a space.

        Only for models with byte pieces and no dummy prefix (ours): encoding the text around
        each ``▁`` separately must not add characters.
        """
        sp = self._sp
        ids = [sp.PieceToId(f"<0x{b:02X}>") for b in _WS.encode()]
        if any(sp.IdToPiece(i) != f"<0x{b:02X}>" for i, b in zip(ids, _WS.encode(), strict=True)):
            return None
        if sp.Encode(_WS) != sp.Encode(" ") or sp.Decode(sp.Encode("a")) != "a":
            return None
        if sp.Decode(sp.Encode("a") + sp.Encode("b")) != "ab":  # a dummy prefix adds spaces
            return None
        return ids

    @property
    def eod(self) -> int:
        """End-of-document id (sentencepiece's eos, as in Megatron-LM).

        Raises:
            ValueError: the model was trained without an eos piece.
        """
        if self._eos < 0:
            raise ValueError(
                f"tokenizer {self.model_path} has no eos piece to use as end-of-document"
            )
        return self._eos

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text (no bos/eos added).

        ``num_threads`` is sentencepiece's own thread count; keep 1 inside worker processes.
        """
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode takes a list of strings; wrap a single one in a list")
        texts = list(texts)
        out = self._sp.Encode(texts, out_type=int, num_threads=num_threads)
        if self._literal_ws is not None:
            for i, text in enumerate(texts):
                if _WS in text:  # rare: encode around each literal U+2581, which becomes bytes
                    parts = self._sp.Encode(text.split(_WS), out_type=int)
                    out[i] = parts[0]
                    for part in parts[1:]:
                        out[i] += self._literal_ws + part
        return out

    def decode(self, ids: list[list[int]] | list[int]) -> list[str] | str:
        """Text of one id list (returns ``str``) or of a batch of them (returns ``list[str]``)."""
        if len(ids) and not isinstance(ids[0], int) and hasattr(ids[0], "__len__"):
            return [self._sp.Decode([int(t) for t in row]) for row in ids]
        return self._sp.Decode([int(t) for t in ids])

    def id_to_piece(self, i: int) -> str:
        """The piece string of id ``i`` (for debugging and tests)."""
        return self._sp.IdToPiece(i)

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``, or the unk id when the model has no such piece."""
        return self._sp.PieceToId(piece)

    def vocabulary(self) -> dict[str, int]:
        """Piece -> id."""
        return {self._sp.IdToPiece(i): i for i in range(self.vocab_size)}

    def __getstate__(self) -> dict:
        # SentencePieceProcessor does not pickle; worker processes reload from the path.
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"
