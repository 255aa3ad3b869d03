"""Open a text corpus through Hugging Face ``datasets``: local files, a saved dataset, or the hub.

Shared by tokenizer training and preprocessing so that both accept the same ``--input``:

* local files, by extension: ``.jsonl``/``.json`` (optionally ``.gz``), ``.parquet``,
  ``.csv``, ``.txt`` (one row per line, column ``text``); several files (or a glob) are read
  as one dataset, in the order given, by :mod:`data.text_files` (only the requested keys;
  unreadable rows skipped and reported with file and line; byte-order marks stripped);
* a directory written by ``Dataset.save_to_disk`` (a ``DatasetDict`` takes ``split``);
* any other directory is handed to ``datasets.load_dataset`` as a data directory;
* anything else is a hub name (``name`` with ``config`` and ``split``), which needs network.

Local files are converted to Arrow once (memory-mapped afterwards), so nothing here holds the
corpus in memory. Only local files get a :class:`~data.text_files.ReadReport`; saved and hub
datasets are read as they are.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import datasets

from data.text_files import ReadReport, read_text_files

_BUILDERS = (
    (".jsonl.gz", "json"),
    (".json.gz", "json"),
    (".jsonl", "json"),
    (".json", "json"),
    (".parquet", "parquet"),
    (".csv", "csv"),
    (".txt", "text"),
    (".txt.gz", "text"),
)


def _builder_for(path: str) -> str | None:
    for ext, builder in _BUILDERS:
        if path.endswith(ext):
            return builder
    return None


_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def _is_hub_name(item: str) -> bool:
    """``name`` or ``owner/name`` that is no local path and has no file extension we read."""
    return (
        bool(_HUB_NAME.fullmatch(item))
        and not item.startswith(".")
        and _builder_for(item) is None
        and not Path(item).exists()
    )


def load_text_dataset(
    inputs: list[str] | str,
    *,
    keys: list[str] | tuple[str, ...] = ("text",),
    config: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Open ``inputs`` as one ``datasets.Dataset``; see :func:`open_text_dataset`."""
    return open_text_dataset(inputs, keys=keys, config=config, split=split, cache_dir=cache_dir)[0]


def open_text_dataset(
    inputs: list[str] | str,
    *,
    keys: list[str] | tuple[str, ...] = ("text",),
    config: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
) -> tuple[datasets.Dataset, ReadReport | None]:
    """Open ``inputs`` as one ``datasets.Dataset`` and say what was skipped reading it.

    Unreadable rows and files without a document are also reported as one ``UserWarning``
    each (file and line of the first few rows).

    Args:
        inputs: file paths/globs (all of one format), one saved-dataset directory, or one hub
            dataset name.
        keys: the text columns wanted; local files are read for these keys only (the
            dataset's columns), other sources keep all their columns.
        config: hub dataset configuration name.
        split: split to read (hub datasets and saved ``DatasetDict`` directories).
        cache_dir: where ``datasets`` keeps its Arrow cache (its default when None).

    Returns:
        The dataset and, for local files, the :class:`~data.text_files.ReadReport` (None for
        saved and hub datasets).

    Raises:
        FileNotFoundError: a local path or glob matches nothing (it is named).
        KeyError: a key is in no local file (the columns that are there are listed).
        ValueError: files of mixed or unknown formats, a missing split, or local files with no
            document at all (``"no documents in FILE"``).
    """
    items = [inputs] if isinstance(inputs, str | os.PathLike) else [os.fspath(i) for i in inputs]
    if not items:
        raise ValueError("no input given")
    if len(items) == 1 and Path(items[0]).is_dir():
        return _load_directory(items[0], split, cache_dir), None
    if len(items) == 1 and _is_hub_name(items[0]):
        return _load_hub(items[0], config, split, cache_dir), None
    files = _local_files(items)
    builders = {_builder_for(f) for f in files}
    if None in builders:
        unknown = [f for f in files if _builder_for(f) is None]
        raise ValueError(f"unknown input format for {unknown}; use .jsonl/.json/.parquet/.csv/.txt")
    if len(builders) > 1:
        raise ValueError(f"inputs mix formats {sorted(builders)}; convert them to one format")
    ds, report = read_text_files(files, builders.pop(), list(keys), cache_dir)
    _warn_about_skipped(report)
    return ds, report


def _load_hub(name: str, config: str | None, split: str, cache_dir: str | None) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as e:  # offline, unknown name, ...: name both readings of the input
        raise FileNotFoundError(
            f"{name!r} is neither a local path nor a loadable hub dataset: {e}"
        ) from e
    return _pick_split(ds, split, name)


def _local_files(items: list[str]) -> list[str]:
    """The files ``items`` name (globs expanded, sorted); FileNotFoundError names a missing one."""
    files: list[str] = []
    for item in items:
        matches = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
        if not matches or not all(Path(m).is_file() for m in matches):
            missing = item if not matches else next(m for m in matches if not Path(m).is_file())
            raise FileNotFoundError(f"input file not found: {missing}")
        files.extend(matches)
    return files


def _warn_about_skipped(report: ReadReport) -> None:
    # stacklevel 4: the line that called open_text_dataset's caller (say, preprocess's caller)
    if report.unreadable:
        warnings.warn(
            f"skipped {report.unreadable} unreadable row(s) of {report.rows + report.unreadable}: "
            + "; ".join(report.examples)
            + ("; ..." if report.unreadable > len(report.examples) else ""),
            stacklevel=4,
        )
    if report.empty_files:
        warnings.warn(f"no documents in {', '.join(report.empty_files)}", stacklevel=4)


def _load_directory(path: str, split: str, cache_dir: str | None) -> datasets.Dataset:
    p = Path(path)
    if (
        (p / "dataset_info.json").is_file()
        or (p / "dataset_dict.json").is_file()
        or (p / "state.json").is_file()
    ):
        return _pick_split(datasets.load_from_disk(path), split, path)
    return _pick_split(datasets.load_dataset(path, split=split, cache_dir=cache_dir), split, path)


def _pick_split(ds, split: str, name: str) -> datasets.Dataset:
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{name} has no split {split!r}; it has {sorted(ds)}")
        return ds[split]
    return ds


def check_columns(ds: datasets.Dataset, keys: list[str]) -> None:
    """Raise KeyError naming the missing keys and the columns that do exist."""
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise KeyError(
            f"json key(s) {missing} not in the dataset; its columns are {ds.column_names}"
        )


def iter_texts(ds: datasets.Dataset, keys: list[str], batch_size: int = 1000) -> Iterator[str]:
    """Yield every valid text of ``keys``, row by row; null or non-string values are skipped."""
    check_columns(ds, keys)
    for batch in ds.select_columns(keys).iter(batch_size=batch_size):
        for key in keys:
            for text in batch[key]:
                if isinstance(text, str):
                    yield text


def add_input_args(parser: argparse.ArgumentParser, json_keys_help: str) -> None:
    """The input flags shared by the tokenizer trainer and the preprocessor: ``--input``,
    ``--dataset-config``, ``--split``, ``--json-keys``."""
    parser.add_argument(
        "--input", nargs="+", required=True, help="files/globs, a saved dataset dir, or a hub name"
    )
    parser.add_argument("--dataset-config", default=None, help="hub dataset configuration")
    parser.add_argument("--split", default="train", help="dataset split to read")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help=json_keys_help)


def exit_with_error(prog: str, message: str) -> NoReturn:
    """One line ``PROG: error: MESSAGE`` on stderr and exit status 2 (argparse's status, without
    its usage block: the message names the flag)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)
