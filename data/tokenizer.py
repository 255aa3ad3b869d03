"""The tokenizer every part of the project uses: a thin wrapper over a sentencepiece model.

Models trained by :mod:`data.train_tokenizer` use byte fallback and no normalisation, so
``decode(encode(s)) == s`` for any string (emoji, CJK, combining marks, runs of spaces,
newlines). Models from elsewhere (Llama's, say) load too; their own round-trip rules apply.
"""

from __future__ import annotations

import os
from pathlib import Path

import sentencepiece as spm


class Tokenizer:
    """A sentencepiece model with the ids a GPT pipeline needs.

    Args:
        model_path: a ``.model`` file.

    Attributes:
        vocab_size: number of ids, ``0 .. vocab_size - 1`` (the model's embedding needs at
            least this many rows).
        bos, pad, unk: special ids, -1 when the model has none.
        model_path: the path it was loaded from.

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: the file is not a readable sentencepiece model.
    """

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
        return self._sp.Encode(list(texts), out_type=int, num_threads=num_threads)

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

    def __getstate__(self) -> dict:
        # SentencePieceProcessor does not pickle; worker processes reload from the path.
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"
