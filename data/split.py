"""Strict parsing of Megatron's ``--split`` string and its document ranges.

``"949,50,1"`` means train/valid/test get 949, 50 and 1 parts of the documents, in order
(contiguous ranges: the split is by document, before any shuffling). Megatron-LM pulls the
numbers out with a regex and so accepts ``"-1,1,0"`` or ``"90,abc5,5"``; here every field
must be a plain non-negative number.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"\d+(\.\d*)?|\.\d+")
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> tuple[float, float, float]:
    """Normalised ``(train, valid, test)`` fractions of ``split``.

    One to three comma-separated non-negative numbers (spaces around them allowed); missing
    trailing fields are 0, so ``"1"`` is all-train and ``"98,2"`` has no test split.

    Raises:
        ValueError: an empty or non-numeric field, a negative or non-finite one, more than three
            fields, or all zero; the message quotes the string.
    """
    fields = [f.strip() for f in split.split(",")]
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
