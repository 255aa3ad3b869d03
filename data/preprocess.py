"""Tokenize a corpus into Megatron-LM indexed datasets: ``python -m data.preprocess``.

Example (the embedded corpus; any hub dataset or local file works the same)::

    python -m data.preprocess --input runs/corpus/stdlib_docs.jsonl --json-keys text \\
        --tokenizer-model runs/tok/spm.model --output-prefix runs/data/stdlib \\
        --workers 2 --append-eod
    # -> runs/data/stdlib_text_document.bin / .idx

Each ``--json-keys`` column becomes its own dataset ``<prefix>_<key>_document`` (Megatron-LM's
naming), one sequence per document, token dtype from the vocabulary size.

Row policy, per key:

* missing, null or non-string values are skipped and counted (one warning at the end);
* a row that cannot be read (invalid UTF-8 in a ``--json-keys`` value, a line that is no JSON
  object) is skipped and counted, its file and line named in a warning; other keys never
  matter (see :mod:`data.text_files`);
* a text that is empty *or only whitespace* is an empty document and produces no sample (no
  lone end-of-document token either): it carries nothing to learn from;
* any other text is tokenized verbatim, leading and trailing whitespace included, and with
  ``--append-eod`` gets the tokenizer's eod (eos) id at its end.

The input goes through ``datasets`` (Arrow on disk, memory-mapped) and is tokenized in chunks
of ``--chunk-documents`` rows with a batched ``Dataset.map`` on ``--workers`` processes; each
chunk's tokens are streamed into the output and its temporary Arrow files deleted, so memory
and scratch disk stay bounded by one chunk. Outputs appear only when everything succeeded:
on any error no ``.bin/.idx`` pair is left behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
from tqdm import tqdm

from data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from data.text_source import add_input_args, check_columns, exit_with_error, open_text_dataset
from data.tokenizer import SENTENCEPIECE_ALIASES, TOKENIZER_TYPES, load_tokenizer


class _Encoder:
    """Batched ``map`` function: text columns in, ``ids_<key>`` token lists out.

    A value that is not a string becomes null (counted as invalid); an empty or blank text an
    empty list (an empty document). Picklable: worker processes load the model themselves.
    """

    def __init__(self, model_path: str, keys: list[str], append_eod: bool,
                 tokenizer_type: str | None = None):
        self.model_path, self.keys, self.append_eod = model_path, keys, append_eod
        self.tokenizer_type = tokenizer_type
        self._tok = None

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path, "keys": self.keys, "append_eod": self.append_eod,
                "tokenizer_type": self.tokenizer_type}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._tok is None:
            self._tok = load_tokenizer(self.model_path, self.tokenizer_type)
        eod = [self._tok.eod] if self.append_eod else []
        out = {}
        for key in self.keys:
            texts = batch[key]
            rows: list[list[int] | None] = [None if not isinstance(t, str) else [] for t in texts]
            todo = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
            for i, ids in zip(todo, self._tok.encode([texts[i] for i in todo]), strict=True):
                rows[i] = ids + eod
            out[f"ids_{key}"] = rows
        return out


@dataclass
class KeyStats:
    """Counts for one ``--json-keys`` column."""

    documents: int = 0  # written (non-empty) documents
    tokens: int = 0  # written tokens, eod included
    invalid: int = 0  # missing, null or non-string rows
    empty: int = 0  # empty or whitespace-only rows


@dataclass
class PreprocessStats:
    """What :func:`preprocess` did."""

    rows: int = 0  # rows read (unreadable ones not included)
    unreadable: int = 0  # rows skipped because they could not be read (invalid UTF-8, not JSON)
    seconds: float = 0.0
    keys: dict[str, KeyStats] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # key -> output prefix

    @property
    def tokens(self) -> int:
        return sum(k.tokens for k in self.keys.values())


def output_prefix_for(output_prefix: str | os.PathLike, key: str) -> str:
    """``<output_prefix>_<key>_document``, Megatron-LM's name for a document-level dataset."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def preprocess(
    inputs: list[str] | str,
    output_prefix: str | os.PathLike,
    tokenizer_model: str | os.PathLike,
    json_keys: list[str] | tuple[str, ...] = ("text",),
    workers: int = 1,
    append_eod: bool = False,
    config: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
    chunk_documents: int = 100_000,
    progress: bool = True,
    tokenizer_type: str | None = None,
) -> PreprocessStats:
    """Tokenize ``inputs`` into ``<output_prefix>_<key>_document.bin/.idx`` for each key.

    Args:
        inputs: see :func:`data.text_source.open_text_dataset`; local files are read for
            ``json_keys`` only, unreadable rows skipped and counted (``stats.unreadable``,
            with file and line in a warning).
        tokenizer_model: a sentencepiece ``.model`` file or a Hugging Face tokenizer directory
            (:func:`data.tokenizer.load_tokenizer`, with ``tokenizer_type``; None: inferred).
            A Hugging Face tokenizer's ids are ``tokenizers``' ``encode`` of each document,
            with the special tokens its post-processor adds (Llama 3: BOS).
        workers: processes for the batched ``map`` (1: in this process).
        append_eod: end every kept document with the tokenizer's eod (EOS) id; nothing else.
        chunk_documents: rows tokenized per ``map`` call; bounds scratch disk and memory.

    Raises:
        FileNotFoundError: an input file or the tokenizer model is missing.
        ValueError: unreadable tokenizer, no eod id with ``append_eod``, input files with no
            document ("no documents in FILE"), or a key that ends up with no document ("empty
            result"); nothing is written.
        KeyError: a key is not a column (the existing columns are listed).
    """
    keys = list(json_keys)
    tok = _checked_tokenizer(tokenizer_model, tokenizer_type, workers, chunk_documents,
                             append_eod)
    ds, report = open_text_dataset(
        inputs, keys=keys, config=config, split=split, cache_dir=cache_dir
    )
    check_columns(ds, keys)
    ds = ds.select_columns(keys)
    stats = PreprocessStats(rows=len(ds), keys={k: KeyStats() for k in keys})
    stats.unreadable = report.unreadable if report else 0
    t0 = time.perf_counter()
    encoder = _Encoder(tok.model_path, keys, append_eod, tok.kind)
    _write_datasets(ds, encoder, dtype_for_vocab(tok.vocab_size), output_prefix, workers,
                    chunk_documents, progress, stats)
    stats.seconds = time.perf_counter() - t0
    skipped = {k: ks.invalid for k, ks in stats.keys.items() if ks.invalid}
    if skipped:
        warnings.warn(
            f"skipped rows whose text is missing, null or not a string: {skipped} "
            f"(of {stats.rows} rows)",
            stacklevel=2,
        )
    return stats


def _checked_tokenizer(model, tokenizer_type, workers: int, chunk_documents: int,
                       append_eod: bool):
    """The tokenizer, after the counts are checked; its eod is checked now (not in a worker)."""
    for flag, value in (("--workers", workers), ("--chunk-documents", chunk_documents)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be 1 or more")
    tok = load_tokenizer(model, tokenizer_type)
    if append_eod:
        tok.eod  # noqa: B018 - raises when the model has no eos
    return tok


def _write_datasets(ds: datasets.Dataset, encoder: _Encoder, dtype,
                    output_prefix: str | os.PathLike, workers: int, chunk_documents: int,
                    progress: bool, stats: PreprocessStats) -> None:
    """Tokenize ``ds`` chunk by chunk into one writer per key, counting into ``stats``; publish
    every output only when all succeeded, abort them all otherwise (and always free the
    scratch directory next to the outputs)."""
    keys = encoder.keys
    writers: dict[str, IndexedDatasetWriter] = {}
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".preprocess-", dir=Path(output_prefix).parent)
    t0 = time.perf_counter()
    bar = tqdm(total=len(ds), unit="doc", unit_scale=True, disable=not progress, desc="tokenizing")
    try:
        for k in keys:
            writers[k] = IndexedDatasetWriter(output_prefix_for(output_prefix, k), dtype)
        for start in range(0, len(ds), chunk_documents):
            part = ds.select(range(start, min(start + chunk_documents, len(ds))))
            out = _map_chunk(part, encoder, workers, os.path.join(scratch, f"chunk{start}.arrow"))
            for table in out.with_format("arrow").iter(batch_size=10_000):
                for k in keys:
                    _write_column(table.column(f"ids_{k}"), writers[k], stats.keys[k])
                bar.update(table.num_rows)
                bar.set_postfix(tok_per_s=f"{stats.tokens / (time.perf_counter() - t0):.3g}")
            del out, part
            for f in Path(scratch).iterdir():  # this chunk is written; free its scratch disk
                f.unlink()
        _check_every_key_has_documents(stats)
        for k, w in writers.items():
            w.finalize()
            stats.outputs[k] = w.prefix
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _map_chunk(part: datasets.Dataset, encoder: _Encoder, workers: int,
               cache_file: str) -> datasets.Dataset:
    """``part`` tokenized (one ``ids_<key>`` column per key), its Arrow data in ``cache_file``."""
    features = datasets.Features(
        {f"ids_{k}": datasets.List(datasets.Value("int32")) for k in encoder.keys})
    return part.map(
        encoder,
        batched=True,
        batch_size=1000,
        remove_columns=encoder.keys,
        features=features,
        num_proc=workers if workers > 1 and len(part) > 1 else None,
        cache_file_name=cache_file,
        load_from_cache_file=False,
        new_fingerprint=uuid.uuid4().hex,
    )


def _check_every_key_has_documents(stats: PreprocessStats) -> None:
    """Raises ValueError ("empty result") for a key that got no document."""
    for k, ks in stats.keys.items():
        if ks.documents == 0:
            raise ValueError(
                f"empty result: no document for key {k!r} in {stats.rows} rows "
                f"({ks.invalid} missing/null/non-string, {ks.empty} empty or blank); "
                "nothing written"
            )


def _write_column(col, writer: IndexedDatasetWriter, ks: KeyStats) -> None:
    """Append one Arrow column of token lists (nulls: invalid rows, []: empty documents)."""
    invalid = np.asarray(pc.is_null(col))
    lengths = np.asarray(pc.list_value_length(col).fill_null(0), dtype=np.int64)
    ks.invalid += int(invalid.sum())
    ks.empty += int(((lengths == 0) & ~invalid).sum())
    kept = lengths[lengths > 0]
    values = np.asarray(pc.list_flatten(col))
    writer.add_sequences(values, kept)
    ks.documents += len(kept)
    ks.tokens += int(values.size)


def _tokenizer_source(p: argparse.ArgumentParser, a: argparse.Namespace):
    """``--tokenizer-model``, or ``(--vocab-file, --merge-file)`` for GPT2BPETokenizer (given
    with the pair, or implied by it); exits with a one-line error for a missing or mixed one."""
    bpe = (a.vocab_file, a.merge_file)
    if a.tokenizer_type == "GPT2BPETokenizer" or any(bpe):
        if a.tokenizer_type not in (None, "GPT2BPETokenizer") or a.tokenizer_model:
            p.error("--vocab-file/--merge-file are GPT2BPETokenizer's; give them or "
                    "--tokenizer-model, not both")
        if not all(bpe):
            p.error("--tokenizer-type GPT2BPETokenizer needs both --vocab-file and --merge-file")
        a.tokenizer_type = "GPT2BPETokenizer"
        return bpe
    if not a.tokenizer_model:
        p.error("give --tokenizer-model (sentencepiece or Hugging Face), or "
                "--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M")
    return a.tokenizer_model


def main(argv: list[str] | None = None) -> None:
    # a user's warning is a line of its own, not a source file and line of this module
    warnings.formatwarning = lambda msg, cat, *_, **__: f"{cat.__name__}: {msg}\n"
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="python -m data.preprocess",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_input_args(p, "text column(s), one output each")
    p.add_argument("--tokenizer-type",
                   choices=TOKENIZER_TYPES + SENTENCEPIECE_ALIASES + ("GPT2BPETokenizer",),
                   help="default: HuggingFaceTokenizer for a directory or .json file, else "
                        "SentencePieceTokenizer; GPT2BPETokenizer with --vocab-file/--merge-file")
    p.add_argument("--tokenizer-model",
                   help="sentencepiece .model file, or a Hugging Face tokenizer directory "
                        "(tokenizer.json + tokenizer_config.json)")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json (Megatron-LM's flag)")
    p.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt (Megatron-LM's flag)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--append-eod", action="store_true", help="end each document with the eod id")
    p.add_argument("--chunk-documents", type=int, default=100_000, help="rows per map call")
    p.add_argument("--cache-dir", default=None, help="datasets cache directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    model = _tokenizer_source(p, a)
    datasets.disable_progress_bars()  # ours reports documents and tokens per second instead
    try:
        s = preprocess(
            a.input,
            a.output_prefix,
            model,
            a.json_keys,
            a.workers,
            a.append_eod,
            a.dataset_config,
            a.split,
            a.cache_dir,
            a.chunk_documents,
            not a.no_progress,
            a.tokenizer_type,
        )
    except (ValueError, FileNotFoundError) as e:  # nothing was written; the message says why
        exit_with_error(p.prog, str(e))
    except KeyError as e:
        exit_with_error(p.prog, e.args[0])
    for k, ks in s.keys.items():
        print(
            f"{s.outputs[k]}: {ks.documents} documents, {ks.tokens} tokens "
            f"({ks.invalid} invalid and {ks.empty} empty rows skipped)"
        )
    print(
        f"{s.rows} rows ({s.unreadable} unreadable skipped), {s.tokens} tokens in {s.seconds:.1f} "
        f"s: {s.rows / s.seconds:.0f} docs/s, {s.tokens / s.seconds:.0f} tokens/s with {a.workers} "
        "worker(s)"
    )


if __name__ == "__main__":
    main()
