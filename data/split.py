"""Strict parsing of Megatron's ``--split`` string and its document ranges.

``"949,50,1"`` means train/valid/test get 949, 50 and 1 parts of the documents, in order
(contiguous ranges: the split is by document, before any shuffling). Megatron-LM pulls the
numbers out with a regex and so accepts ``"-1,1,0"`` or ``"90,abc5,5"``; here every field
must be a plain non-negative number. Quotes around the string are dropped, as Megatron-LM's regex
drops them: a script's ``SPLIT="'99,1,0'"`` expanded unquoted passes the quotes literally.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"\d+(\.\d*)?|\.\d+")
SPLIT_NAMES = ("train", "valid", "test")


def unquote_split(split: str) -> str:
    """``split`` without the quotes around it (``"'99,1,0'"`` -> ``"99,1,0"``)."""
    return split.strip().strip("'\"").strip()


def parse_split(split: str) -> tuple[float, float, float]:
    """Normalised ``(train, valid, test)`` fractions of ``split``.

    One to three comma-separated non-negative numbers (spaces around them allowed); missing
    trailing fields are 0, so ``"1"`` is all-train and ``"98,2"`` has no test split.

    Raises:
        ValueError: an empty or non-numeric field, a negative or non-finite one, more than three
            fields, or all zero; the message quotes the string.
    """
    fields = [f.strip() for f in unquote_split(split).split(",")]
    if not 1 <= len(fields) <= 3:
        raise ValueError(
            f"--split {split!r}: expected 1 to 3 comma-separated numbers, got {len(fields)}"
        )
    values = []
    for f in fields:
        if not _NUMBER.fullmatch(f):
            raise ValueError(f"--split {split!r}: field {f!r} is not a non-negative number")
        values.append(float(f))
    total = sum(values)
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"--split {split!r}: the weights must be finite and not all zero")
    values += [0.0] * (3 - len(values))
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_ranges(fractions: tuple[float, ...], num_documents: int) -> list[tuple[int, int]]:
    """``[start, end)`` document ranges per split; they tile ``[0, num_documents)`` exactly.

    Boundaries are ``round(cumulative fraction * num_documents)``, so the last ends at
    ``num_documents`` and rounding never loses or duplicates a document.
    """
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(min(num_documents, round(acc * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def split_sizes(fractions: tuple[float, ...], num_documents: int) -> list[int]:
    """Documents per split (:func:`split_ranges`)."""
    return [hi - lo for lo, hi in split_ranges(fractions, num_documents)]


def skipped_splits(fractions: tuple[float, ...], doc_counts: list[int]) -> list[str]:
    """The evaluation splits (valid, test) with a share in ``fractions`` that hold no document in
    any of the datasets of ``doc_counts`` (documents per blended dataset). They are skipped, as
    Megatron-LM skips an empty split (its data loader is None, so it is never evaluated): on a
    441-document corpus the default ``--split 969,30,1`` gives the test split 0.44 documents."""
    sizes = [split_sizes(fractions, n) for n in doc_counts]
    return [name for i, name in enumerate(SPLIT_NAMES) if i and fractions[i] > 0
            and all(s[i] == 0 for s in sizes)]


def _format(parts: list[int]) -> str:
    return ",".join(str(p) for p in parts)


def suggest_split(split: str, doc_counts: list[int], needed: tuple[str, ...]) -> str | None:
    """A ``--split`` that gives every split in ``needed`` at least one document of every dataset
    (``doc_counts``: documents per blended dataset), or None when no split can (a dataset with
    fewer documents than needed splits). Never the given ``split``, nor one that fails in turn:
    the candidate is checked with :func:`split_ranges` before it is advised.

    The candidate keeps the given proportions in thousandths and raises each needed share that
    is too small to the least that gives the smallest dataset one document, taken from the
    largest share that is not raised.
    """
    fractions = parse_split(split)
    smallest = min(doc_counts)
    idx = [SPLIT_NAMES.index(n) for n in needed]
    if smallest < len(idx):
        return None
    parts = [round(f * 1000) for f in fractions]
    for scale in (1, 2, 5, 10, 20, 50, 100):
        cand = list(parts)
        raised = [i for i in idx if cand[i] < math.ceil(scale * 1000 / smallest)]
        for i in raised:
            cand[i] = math.ceil(scale * 1000 / smallest)
        donor = max((i for i in range(3) if i not in raised), key=lambda i: cand[i], default=0)
        cand[donor] -= sum(cand) - 1000
        if cand[donor] <= 0:
            return None
        new = parse_split(_format(cand))
        if new != fractions and all(split_sizes(new, n)[i] > 0 for n in doc_counts for i in idx):
            return _format(cand)
    return None


def skipped_eval_splits(data_path: list[str], split: str) -> list[str]:
    """:func:`skipped_splits` of the datasets that ``--data-path`` names (their index files are
    read for the document counts)."""
    from data.blended_dataset import parse_data_path
    from data.indexed_dataset import IndexedDataset

    _, prefixes = parse_data_path(data_path)
    counts = [len(IndexedDataset(p).document_indices) - 1 for p in prefixes]
    return skipped_splits(parse_split(split), counts)


def skip_note(split: str, name: str) -> str:
    """The start-up note for an evaluation split that :func:`skipped_splits` skips."""
    return (f"note: --split {split} gives the {name} split no whole document of --data-path, "
            f"so it is skipped as Megatron-LM skips an empty split (no {name} evaluation); give "
            f"it a larger share to evaluate it")


def no_validation_note(split: str, eval_iters: int) -> str | None:
    """The start-up note for ``--split`` giving the validation split no share while
    ``--eval-iters`` asks for evaluation (None otherwise): Megatron-LM builds no validation
    dataset then and skips every validation without a word (its ``do_valid`` needs a data
    loader); the test split, when it has a share, is still evaluated at the end."""
    _, valid, test = parse_split(split)
    if not eval_iters or valid > 0:
        return None
    if test > 0:
        return (f"note: --split {split} gives the validation split no share: there is no "
                f"validation data, so no validation runs (--eval-iters {eval_iters}, "
                "--eval-interval); only the test split is evaluated, at the end (as Megatron-LM "
                "does). Give the validation split a share to evaluate during training")
    return (f"note: --split {split} gives the validation and test splits no share: there is no "
            f"evaluation data, so --eval-iters {eval_iters} evaluates nothing (as Megatron-LM "
            "skips it). Give them a share (say --split 969,30,1) to evaluate, or --eval-iters 0")
