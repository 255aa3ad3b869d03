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
