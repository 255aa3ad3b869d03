"""The tokenizer of an exported model: which one, whether it fits the model, and its files.

A sentencepiece model is translated to ``tokenizer.json`` (:mod:`hybrid.hf.tokenizer`); a Hugging
Face tokenizer's own files are copied unchanged. Either way the tokenizer must be the model's:
a sentencepiece vocabulary of exactly the model's size, a Hugging Face one no larger (Qwen's
models have more rows than tokens), and, when ``--tokenizer-model`` overrides the tokenizer the
checkpoint was trained with and that one is still on disk, the same vocabulary (token -> id).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "chat_template.jinja")


def _load(path, kind):
    from data.tokenizer import load_tokenizer

    return load_tokenizer(path, kind)


def tokenizer_source(given: str | os.PathLike | None, kind: str | None, meta: dict,
                     vocab_size: int):
    """The tokenizer to export (``given``, else the checkpoint's), loaded; None when neither.

    Raises:
        FileNotFoundError: the tokenizer is missing.
        ValueError: its vocabulary is not the model's (sizes, or tokens differing from the
            tokenizer the checkpoint names), with both sizes or the first differing token.
    """
    named = meta.get("tokenizer")
    trained_kind = ((meta.get("config") or {}).get("data") or {}).get("tokenizer_type")
    path = given or named
    if not path:
        return None
    if not Path(path).exists():
        raise FileNotFoundError(f"--tokenizer-model {path}: not found" if given else
                                f"tokenizer {path} (named by the checkpoint) not found: give "
                                "--tokenizer-model")
    tok = _load(path, kind or (None if given else trained_kind))
    hf = tok.kind == "HuggingFaceTokenizer"
    if tok.vocab_size > vocab_size or (not hf and tok.vocab_size != vocab_size):
        raise ValueError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's "
                         f"vocabulary is {vocab_size}: it is not this model's tokenizer")
    if given and named and Path(named).exists() and Path(named).resolve() != Path(
            given).resolve():
        _check_same_vocabulary(tok, _load(named, trained_kind), given, named)
    return tok


def _check_same_vocabulary(tok, trained, given, named) -> None:
    ours, theirs = tok.vocabulary(), trained.vocabulary()
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[0]
        raise ValueError(f"--tokenizer-model {given} differs from the tokenizer the checkpoint "
                         f"was trained with ({named}): token {diff[0]!r} (id {diff[1]}) is in "
                         "one vocabulary only")


def export_tokenizer(tok, directory: Path) -> dict[str, int | None]:
    """Write ``tok``'s files into ``directory``; returns ``bos_token_id`` / ``eos_token_id``
    / ``pad_token_id`` (None where it has none) for ``config.json`` and
    ``generation_config.json``."""
    if tok.kind == "SentencePieceTokenizer":
        from hybrid.hf.tokenizer import save_tokenizer

        ids = save_tokenizer(tok.model_path, directory)
    else:
        from data.hf_tokenizer import hf_tokenizer_files

        tok_file, _ = hf_tokenizer_files(tok.model_path)
        for name in _HF_FILES:
            if (tok_file.parent / name).is_file():
                shutil.copyfile(tok_file.parent / name, directory / name)
        ids = {f"{k}_token_id": v for k, v in (("bos", tok.bos), ("eos", tok._eos),
                                                ("pad", tok.pad)) if v >= 0}
    return {k: ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
