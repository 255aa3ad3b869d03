"""GPT-2 byte-level BPE vocabularies given as Megatron-LM's ``--vocab-file`` / ``--merge-file``.

Data preprocessed with Megatron-LM's ``GPT2BPETokenizer`` is ``.bin/.idx`` token ids of that
vocabulary; training needs only its size (Megatron-LM's ``vocab_size`` is the number of entries
of ``vocab.json``, ``<|endoftext|>`` included: 50257 for GPT-2). The pair is read through
``transformers``' ``GPT2TokenizerFast`` (the Hugging Face ``tokenizers`` BPE), so a malformed
file fails here rather than later.
"""

from __future__ import annotations

import json
from pathlib import Path


def gpt2_bpe_vocab_size(vocab_file: str, merge_file: str) -> int:
    """The vocabulary size of a GPT-2 BPE ``vocab.json`` / ``merges.txt`` pair (tokens).

    Raises:
        ValueError: a missing file, or files that do not form a byte-level BPE tokenizer.
    """
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not Path(path).is_file():
            raise ValueError(f"{flag} {path}: file not found")
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        raise ValueError("--vocab-file / --merge-file need the tokenizers package (the project's "
                         "hf extra)") from None
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        size = ByteLevelBPETokenizer(vocab_file, merge_file).get_vocab_size()
    except Exception as e:  # json and tokenizers (Rust) raise their own kinds
        raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file} are not a GPT-2 "
                         f"BPE vocabulary: {e}") from None
    if not isinstance(vocab, dict) or len(vocab) != size:
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id "
                         f"({len(vocab)} entries, {size} distinct ids)")
    return size


class GPT2BPETokenizer:
    """Megatron-LM's ``--tokenizer-type GPT2BPETokenizer`` for ``data.preprocess``: transformers'
    ``GPT2TokenizerFast`` on the ``--vocab-file`` / ``--merge-file`` pair, whose ids of a text
    are what Megatron-LM's ``tools/preprocess_data.py`` writes (its tokenizer is that class,
    called on the text; GPT-2 adds no BOS or EOS); the end-of-document id is ``<|endoftext|>``.

    ``model_path`` is ``(vocab_file, merge_file)``, so that worker processes can load it again.

    Raises:
        ValueError: see :func:`gpt2_bpe_vocab_size`, or a vocabulary without ``<|endoftext|>``.
    """

    kind = "GPT2BPETokenizer"

    def __init__(self, model_path: tuple[str, str]):
        from transformers import GPT2TokenizerFast

        vocab_file, merge_file = model_path
        self.vocab_size = gpt2_bpe_vocab_size(vocab_file, merge_file)
        self.model_path = (str(vocab_file), str(merge_file))
        # positional: transformers 5 ignores the vocab_file=/merges_file= keywords and builds
        # an empty tokenizer that encodes every text to [] (a dataset of end-of-document ids)
        self._tok = GPT2TokenizerFast(str(vocab_file), str(merge_file))
        vocab = self._tok.get_vocab()
        if len(vocab) != self.vocab_size:
            raise ValueError(f"--vocab-file {vocab_file}: transformers' GPT2TokenizerFast read "
                             f"{len(vocab)} of its {self.vocab_size} tokens")
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no <|endoftext|>, the "
                             "end-of-document token of GPT2BPETokenizer")
        self._eod = vocab["<|endoftext|>"]
        self.bos, self.adds_bos = -1, False

    @property
    def eod(self) -> int:
        """End-of-document id: ``<|endoftext|>``."""
        return self._eod

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, ``GPT2TokenizerFast(text).input_ids`` (one call per batch)."""
        return list(self._tok(list(texts), add_special_tokens=True)["input_ids"]) if texts else []

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)
