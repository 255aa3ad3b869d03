"""Read local text files row by row into a memory-mapped Arrow dataset of the requested keys.

Formats by extension: ``.jsonl``/``.json`` (JSON lines, or one JSON array), ``.txt`` (one row
per line, column ``text``), ``.csv`` (a header row), ``.parquet``; the line formats also as
``.gz``. The ``datasets`` builders are not used for these because each fails a whole file on
one bad row: they read every key of every row (a key that first appears after the schema was
inferred from the first 10 MB is a ``CastError``), stop at one invalid UTF-8 byte with an error
naming neither file nor line, and keep a ``.txt`` byte-order mark as content. Here:

* only the requested keys are read; other keys, their types and their bytes never matter;
* a row that cannot be read (invalid UTF-8 or a lone surrogate in a requested value, a line
  that is not a JSON object) is skipped and reported with its file and line;
* a leading UTF-8 byte-order mark is stripped from every file;
* a value that is missing, null or not a string becomes null (callers count it as invalid);
* a file with no document (no non-blank string under any key) is named: an error when no
  input file has one, a warning otherwise.

The rows are written once to an Arrow file under the cache directory, keyed by the files'
paths and contents (SHA-256 of their bytes: :func:`data.index_cache.file_digest`) and the keys,
and memory-mapped afterwards.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
from datasets.arrow_writer import ArrowWriter

from data.index_cache import file_digest

FORMAT_VERSION = 1  # bump when the row policy changes: it is part of the cache key
EXAMPLES_KEPT = 5  # unreadable rows named in the report (all are counted)
_BOM = "\ufeff"


@dataclass
class ReadReport:
    """What :func:`read_text_files` read.

    Attributes:
        files: the input files, in order.
        rows: rows written (documents, empty and invalid ones included).
        unreadable: rows skipped because they could not be read.
        examples: ``"FILE:LINE: reason"`` of the first unreadable rows.
        empty_files: files with no document.
        columns: every key seen in the files, in order of appearance.
    """

    files: list[str]
    rows: int = 0
    unreadable: int = 0
    examples: list[str] = field(default_factory=list)
    empty_files: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)

    def skip(self, where: str, reason: str) -> None:
        """Count one unreadable row at ``where`` (``FILE:LINE``), naming the first few."""
        self.unreadable += 1
        if len(self.examples) < EXAMPLES_KEPT:
            self.examples.append(f"{where}: {reason}")


def _opened(path: str):
    """Binary stream of ``path``, gunzipped for ``.gz``."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _decode(raw: bytes, first: bool) -> str:
    """UTF-8 with invalid bytes kept as lone surrogates (found later only in requested values)."""
    text = raw.decode("utf-8", errors="surrogateescape")
    return text[1:] if first and text.startswith(_BOM) else text


def _bad_text(value: str) -> str | None:
    """Why ``value`` cannot be stored as UTF-8 (an invalid input byte, a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        if "\udc80" <= bad <= "\udcff":
            return f"invalid UTF-8 byte 0x{ord(bad) - 0xDC00:02x} at character {e.start}"
        return f"lone surrogate U+{ord(bad):04X} at character {e.start}"
    return None


def _row(obj: dict, keys: list[str], where: str, report: ReadReport, seen: dict) -> dict | None:
    """The requested keys of one record (non-strings null), or None when one is unreadable."""
    seen.update(dict.fromkeys(obj))
    row = {}
    for k in keys:
        v = obj.get(k)
        if isinstance(v, str):
            why = _bad_text(v)
            if why:
                report.skip(where, f"{why} in {k!r}")
                return None
        row[k] = v if isinstance(v, str) else None
    return row


def _json_rows(path: str, keys: list[str], report: ReadReport, seen: dict) -> Iterator[dict]:
    with _opened(path) as f:
        head = f.read(64 * 1024)
        first = _decode(head, True).lstrip()
        if first.startswith("["):  # one JSON array: objects, or strings meaning {"text": s}
            try:
                items = json.loads(_decode(head + f.read(), True))
            except ValueError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
            for i, item in enumerate(items, 1):
                obj = {"text": item} if isinstance(item, str) else item
                if not isinstance(obj, dict):
                    report.skip(f"{path}:item {i}", "not a JSON object")
                    continue
                row = _row(obj, keys, f"{path}:item {i}", report, seen)
                if row is not None:
                    yield row
            return
        f.seek(0)
        for n, raw in enumerate(f, 1):
            line = _decode(raw, n == 1)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                report.skip(f"{path}:{n}", f"not JSON ({e})")
                continue
            if not isinstance(obj, dict):
                report.skip(f"{path}:{n}", f"a JSON {type(obj).__name__}, not an object")
                continue
            row = _row(obj, keys, f"{path}:{n}", report, seen)
            if row is not None:
                yield row


def _txt_rows(path: str, keys: list[str], report: ReadReport, seen: dict) -> Iterator[dict]:
    seen["text"] = None
    with _opened(path) as f:
        for n, raw in enumerate(f, 1):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                report.skip(
                    f"{path}:{n}", f"invalid UTF-8 byte 0x{raw[e.start]:02x} at byte {e.start}"
                )
                continue
            yield _row(
                {"text": line[1:] if n == 1 and line.startswith(_BOM) else line},
                keys,
                "",
                report,
                {},
            )


def _csv_rows(path: str, keys: list[str], report: ReadReport, seen: dict) -> Iterator[dict]:
    csv.field_size_limit(sys.maxsize)  # documents are longer than csv's 128 kB field default
    with _opened(path) as raw:
        stream = (_decode(line, n == 0) for n, line in enumerate(raw))
        reader = csv.DictReader(stream)
        for obj in reader:
            obj.pop(None, None)  # fields beyond the header
            row = _row(obj, keys, f"{path}:{reader.line_num}", report, seen)
            if row is not None:
                yield row


def _parquet_rows(path: str, keys: list[str], report: ReadReport, seen: dict) -> Iterator[dict]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    seen.update(dict.fromkeys(pf.schema_arrow.names))
    present = [k for k in keys if k in pf.schema_arrow.names]
    start = 0
    for batch in pf.iter_batches(batch_size=1000, columns=present):
        for i in range(batch.num_rows):
            where = f"{path}:row {start + i + 1}"
            try:
                obj = {k: batch.column(k)[i].as_py() for k in present}
            except UnicodeDecodeError as e:
                report.skip(where, f"invalid UTF-8 ({e.reason})")
                continue
            row = _row(obj, keys, where, report, {})
            if row is not None:
                yield row
        start += batch.num_rows


_READERS = {"json": _json_rows, "text": _txt_rows, "csv": _csv_rows, "parquet": _parquet_rows}


def _cache_key(files: list[str], keys: list[str]) -> str:
    """The cache entry's name: the files' paths and contents (SHA-256, one read of each file:
    a size and modification time survive ``cp -p`` over a changed file) and the keys."""
    stats = [(os.path.abspath(f), file_digest(f)) for f in files]
    blob = json.dumps({"v": FORMAT_VERSION, "files": stats, "keys": keys})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_text_files(
    files: list[str], builder: str, keys: list[str], cache_dir: str | None = None
) -> tuple[datasets.Dataset, ReadReport]:
    """Read ``files`` (all of one ``builder``: json, text, csv, parquet) into a dataset.

    Returns:
        A ``datasets.Dataset`` with one string column per key (null: missing, null or not a
        string), rows in file order, memory-mapped from the cache; and the :class:`ReadReport`.

    Raises:
        KeyError: a key appears in no file (the columns that do appear are listed).
        ValueError: no file has a document (``"no documents in FILE"``), or a ``.json`` array
            file is not valid JSON (named).
    """
    root = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "text_files"
    final = root / _cache_key(files, keys)
    if not (final / "report.json").is_file():
        tmp = root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            report = _write(files, builder, keys, tmp / "data.arrow")
            (tmp / "report.json").write_text(json.dumps(asdict(report)))
            try:
                os.rename(tmp, final)
            except OSError:  # another process wrote the same files first: use its copy
                if not (final / "report.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    report = ReadReport(**json.loads((final / "report.json").read_text()))
    missing = [k for k in keys if k not in report.columns]
    if missing and report.rows:
        raise KeyError(
            f"json key(s) {missing} not in the dataset; its columns are {report.columns}"
        )
    if len(report.empty_files) == len(files):
        unreadable = (
            f"; {report.unreadable} unreadable, the first {report.examples[0]}"
            if report.unreadable
            else ""
        )
        raise ValueError(
            f"no documents in {', '.join(files)} ({report.rows} rows, none with a non-blank "
            f"text under {keys}{unreadable})"
        )
    return datasets.Dataset.from_file(str(final / "data.arrow")), report


def _write(files: list[str], builder: str, keys: list[str], out: Path) -> ReadReport:
    report = ReadReport(files=list(files))
    seen: dict = {}
    features = datasets.Features({k: datasets.Value("string") for k in keys})
    with ArrowWriter(features=features, path=str(out), writer_batch_size=1000) as writer:
        for path in files:
            documents = 0
            batch: list[dict] = []
            for row in _READERS[builder](path, keys, report, seen):
                documents += any(isinstance(v, str) and v.strip() for v in row.values())
                batch.append(row)
                if len(batch) == 1000:
                    writer.write_batch({k: [r[k] for r in batch] for k in keys})
                    report.rows += len(batch)
                    batch = []
            if batch:
                writer.write_batch({k: [r[k] for r in batch] for k in keys})
                report.rows += len(batch)
            if not documents:
                report.empty_files.append(path)
        writer.finalize()
    report.columns = list(seen)
    return report
