"""Local Hugging Face fixtures (no hub): a byte-level BPE ``tokenizer.json`` trained with the
``tokenizers`` library, and the texts that test it."""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HARD_TEXTS = ["é😀 ok 🧑\u200d🤝\u200d🧑", "汉字と仮名、한국어", "e\u0301 a\u0308\u0323 n\u0303",
              "  two  spaces\n\nand\ttabs ", "\u2581 sentencepiece's \u2581 symbol \u2581\u2581",
              "<|end_of_text|> spelled out", "\x00\x7f control", "", "x" * 20_000 + " 长" * 15_000]
"""Emoji (a ZWJ sequence), CJK, combining marks, whitespace runs, U+2581, a spelled-out special,
control characters, an empty row and a 50k-character row."""


def byte_bpe_tokenizer(directory: Path, texts: list[str], vocab_size: int = 400,
                       bos: bool = True) -> Path:
    """Train a byte-level BPE (GPT-2 / Llama 3 / Qwen style) on ``texts`` and save
    ``tokenizer.json`` + ``tokenizer_config.json`` in ``directory``.

    With ``bos`` the post-processor puts ``<|begin_of_text|>`` before every text (Llama 3);
    without it nothing is added (Qwen). ``<|end_of_text|>`` is the EOS either way.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = (processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
        if bos else processors.ByteLevel(trim_offsets=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS if bos else None,
           "eos_token": EOS, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return directory
