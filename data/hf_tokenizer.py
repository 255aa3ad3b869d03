"""A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) behind the interface of
:class:`data.tokenizer.Tokenizer`: ``--tokenizer-type HuggingFaceTokenizer``.

Megatron-LM's ``HuggingFaceTokenizer`` with a local directory: ``--tokenizer-model DIR`` holds
``tokenizer.json`` (a byte-level BPE such as Llama 3's or Qwen's, or any model ``tokenizers``
reads) and ``tokenizer_config.json``, which names the special tokens.

- :meth:`HFTokenizer.encode` is ``tokenizers``' own ``encode`` of each text with its special
  tokens (``add_special_tokens=True``, as Megatron-LM's ``tokenizer(text).input_ids``): the
  tokenizer's post-processor decides them. Llama 3's adds ``<|begin_of_text|>`` (BOS) before
  every document; GPT-2's and Qwen's add nothing.
- The end-of-document id (EOD) is the tokenizer's EOS (``eos_token`` of
  ``tokenizer_config.json``): what ``data.preprocess --append-eod`` appends, and nothing else
  is appended (no second BOS, no EOS of the post-processor's own).
- :meth:`HFTokenizer.decode` drops special tokens (BOS, EOS), as sentencepiece's decode drops
  its control pieces.

Byte-level BPE (no normalizer) gives back every string, ``decode(encode(s)) == s``; tokenizers
with a normalizer give back the normalised text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def _token_name(value) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def hf_tokenizer_files(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """``(tokenizer.json, tokenizer_config.json or None)`` of a directory (or of a
    ``tokenizer.json`` given directly).

    Raises:
        FileNotFoundError: no ``tokenizer.json`` there (the message names the path).
    """
    p = Path(path)
    tok = p / TOKENIZER_FILE if p.is_dir() else p
    if not tok.is_file() or tok.suffix != ".json":
        raise FileNotFoundError(
            f"--tokenizer-model {path}: no {TOKENIZER_FILE} (a Hugging Face tokenizer directory "
            "holds tokenizer.json and tokenizer_config.json)")
    cfg = tok.parent / CONFIG_FILE
    return tok, cfg if cfg.is_file() else None


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer with the ids a GPT pipeline needs.

    Args:
        model_path: a directory with ``tokenizer.json`` (and ``tokenizer_config.json``), or the
            ``tokenizer.json`` file itself.

    Attributes:
        vocab_size: number of ids, ``max id + 1`` over the vocabulary and added tokens.
        bos, pad, unk: special ids from ``tokenizer_config.json``, -1 when absent.
        adds_bos: True when :meth:`encode` starts every text with ``bos`` (Llama 3).
        model_path: the path it was loaded from.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: the file is not a tokenizer ``tokenizers`` can read, or a special token of
            ``tokenizer_config.json`` is not in its vocabulary.
    """

    kind = "HuggingFaceTokenizer"

    def __init__(self, model_path: str | os.PathLike):
        from tokenizers import Tokenizer as RustTokenizer

        self.model_path = os.fspath(model_path)
        tok_file, cfg_file = hf_tokenizer_files(model_path)
        try:
            self._tok = RustTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises its own exception type
            raise ValueError(f"cannot read Hugging Face tokenizer {tok_file}: {e}") from e
        cfg = json.loads(cfg_file.read_text()) if cfg_file else {}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        ids = {}
        for key in ("bos", "eos", "pad", "unk"):
            name = _token_name(cfg.get(f"{key}_token"))
            if name is not None and name not in vocab:
                raise ValueError(f"{cfg_file}: {key}_token {name!r} is not in the vocabulary of "
                                 f"{tok_file}")
            ids[key] = vocab[name] if name is not None else -1
        self.bos, self._eos, self.pad, self.unk = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        probe = self._tok.encode("a").ids
        self.adds_bos: bool = self.bos >= 0 and bool(probe) and probe[0] == self.bos

    @property
    def eod(self) -> int:
        """End-of-document id: the tokenizer's EOS (``eos_token`` of tokenizer_config.json).

        Raises:
            ValueError: the tokenizer names no EOS.
        """
        if self._eos < 0:
            raise ValueError(f"tokenizer {self.model_path} names no eos_token (in "
                             f"{CONFIG_FILE}) to use as end-of-document")
        return self._eos

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """``tokenizers``' ids of each text, special tokens of its post-processor included.

        ``num_threads`` is accepted for the interface; ``encode`` runs one text at a time here
        (worker processes parallelise, and ids never depend on it).
        """
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode takes a list of strings; wrap a single one in a list")
        return [self._tok.encode(t, add_special_tokens=True).ids for t in texts]

    def decode(self, ids: list[list[int]] | list[int]) -> list[str] | str:
        """Text of one id list (returns ``str``) or of a batch (``list[str]``); special tokens
        (BOS, EOS) are dropped."""
        if len(ids) and not isinstance(ids[0], int) and hasattr(ids[0], "__len__"):
            return [self._tok.decode([int(t) for t in row]) for row in ids]
        return self._tok.decode([int(t) for t in ids])

    def id_to_piece(self, i: int) -> str:
        """The token string of id ``i``."""
        return self._tok.id_to_token(i)

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``; ``unk`` when it is not in the vocabulary."""
        i = self._tok.token_to_id(piece)
        return self.unk if i is None else i

    def vocabulary(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"
