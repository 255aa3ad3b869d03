"""Checks of the data flags against the files they name, before any process group starts: the
split, the ``.bin``/``.idx`` pairs, their tokens against the vocabulary, and empty splits.

``hybrid.job.config_checks`` calls :func:`check_data` and reports its ``ValueError`` as the
pretraining command line's one-line error.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.blended_dataset import parse_data_path
from data.indexed_dataset import IndexedDataset
from data.split import SPLIT_NAMES, parse_split, skipped_splits, split_sizes, suggest_split

NO_DATA = ("no training data given: give --data-path PREFIX (a preprocessed <prefix>.bin/.idx "
           "pair) with --tokenizer-model, or --mock-data --vocab-size N")
"""The refusal of a run that names no training data."""

TOKEN_SAMPLE = 1 << 20
"""Tokens read from the start of each dataset to check them against the vocabulary (4 MiB at
most); the training loop checks every micro-batch too (:func:`data.batches.checked_tokens`)."""


def _check_pair(prefix: str) -> None:
    """Raise ``ValueError`` when ``prefix.bin`` or ``prefix.idx`` is missing, saying to drop
    the extension of a ``prefix`` that names ``X.bin`` or ``X.idx``, else suggesting the
    ``<prefix>_<key>_document`` datasets beside it (what ``data.preprocess --output-prefix
    <prefix>`` writes, one per ``--json-keys`` column) when there are any."""
    missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
    if not missing:
        return
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx"):  # Megatron-LM's --data-path names the prefix of the pair
        lacks = [stem + s for s in (".bin", ".idx") if not Path(stem + s).is_file()]
        raise ValueError(f"--data-path {prefix} names a file of the pair: give the prefix "
                         f"without the extension, --data-path {stem}"
                         + (f" (which lacks {', '.join(lacks)})" if lacks else ""))
    msg = f"--data-path {prefix}: missing {', '.join(prefix + s for s in missing)}"
    base = Path(prefix)
    found = sorted(str(p)[:-len(".idx")] for p in base.parent.glob(base.name + "_*_document.idx")
                   if p.with_suffix(".bin").is_file())
    if found:
        msg += (f"; data.preprocess --output-prefix {prefix} writes <prefix>_<key>_document: "
                f"did you mean --data-path {' or '.join(found)}?")
    raise ValueError(msg)


def check_data(split: str, data_path: list[str] | None, mock_data: bool, eval_iters: int,
               vocab: int, source: str) -> None:
    """The data flags name data that trains the model: a ``--split`` giving train a share, the
    ``--data-path`` pairs present, their first tokens inside the vocabulary ``[0, vocab)`` of
    ``source`` (the flag that set it), and every used split holding a document of every dataset.

    Raises:
        ValueError: the first problem, naming the flag and the value.
    """
    train_share = parse_split(split)[0]
    if train_share <= 0:
        raise ValueError(f"--split {split} gives the train split no share of the data; put a "
                          "positive train proportion first (e.g. --split 969,30,1)")
    if mock_data:  # with --data-path too: refused by the vocabulary check, which runs first
        return
    if not data_path:
        raise ValueError(NO_DATA)
    try:
        _, prefixes = parse_data_path(data_path)
    except ValueError as e:
        raise ValueError(f"--data-path {' '.join(map(str, data_path))}: {e}") from None

    counts = []
    for prefix in prefixes:
        _check_pair(prefix)
        ds = IndexedDataset(prefix)
        counts.append(len(ds.document_indices) - 1)
        head = ds.all_tokens[:TOKEN_SAMPLE]  # a mismatched tokenizer shows in the first tokens
        if len(head) and int(head.max()) >= vocab:
            raise ValueError(
                f"--data-path {prefix} holds token id {int(head.max())}, outside the vocabulary "
                f"[0, {vocab}) of {source}: the data was preprocessed with another tokenizer (give "
                "that one, or preprocess again)")
    _check_split_sizes(split, eval_iters > 0, prefixes, counts)


def _check_split_sizes(split: str, evals: bool, prefixes: list[str], counts: list[int]) -> None:
    """Every split that is used holds a document of every dataset. An evaluation split empty in
    all of them is skipped (``data.split.skipped_splits``, as Megatron-LM); one empty in some
    dataset of a blend is an error whose advice is checked to work and is never the given
    ``--split`` (``data.split.suggest_split``)."""
    fractions = parse_split(split)
    skipped = skipped_splits(fractions, counts) if evals else []
    needed = ("train",) + tuple(n for i, n in enumerate(SPLIT_NAMES)
                                if i and evals and fractions[i] > 0 and n not in skipped)
    for prefix, docs in zip(prefixes, counts, strict=True):
        empty = [n for n in needed if split_sizes(fractions, docs)[SPLIT_NAMES.index(n)] == 0]
        if not empty:
            continue
        name, advice = empty[0], suggest_split(split, counts, needed)
        fixes = [f"give --split {advice}"] if advice else []
        if len(prefixes) > 1:
            fixes.append(f"drop {prefix} from --data-path")
        if name != "train":
            fixes += [f"give the {name} split no share", "set --eval-iters 0"]
        raise ValueError(f"--split {split} leaves the {name} split of {prefix} ({docs} "
                          f"document{'s' if docs != 1 else ''}) empty; " + ", or ".join(fixes))
