"""Shared pieces of the data tests: a tiny corpus, a tiny tokenizer, jsonl writing, world
functions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from data.build_corpus import build_corpus
from data.train_tokenizer import train_tokenizer

TINY_VOCAB = 600


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts, or strings that become ``{"text": s}``) as jsonl; return the path."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(
                json.dumps(r if isinstance(r, dict) else {"text": r}, ensure_ascii=False) + "\n"
            )
    return path


def tiny_corpus(directory: Path, max_bytes: int = 150_000) -> Path:
    """The first ~150 kB of the embedded stdlib corpus (about 60 documents)."""
    out = directory / "corpus.jsonl"
    build_corpus(out, max_bytes=max_bytes)
    return out


def tiny_tokenizer(directory: Path) -> Path:
    """Train a 600-id BPE tokenizer on the tiny corpus (well under a second); return the .model."""
    corpus = tiny_corpus(directory)
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    train_tokenizer(texts, directory / "tok", TINY_VOCAB, user_defined_symbols=["<|sep|>"])
    return directory / "tok.model"


def write_token_dataset(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> Path:
    """An indexed dataset holding exactly ``docs``."""
    from data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d))
    return prefix


# ---- functions run on every rank of a spawned world (module level so spawn can import them)


def world_build_and_load(rank: int, world_size: int, prefix: str, cache_dir: str) -> dict:
    """Build datasets rank-0-first, load batches, and exercise the failure and timeout paths."""
    from data.gpt_dataset import build_gpt_datasets
    from data.loader import build_data_loader
    from data.rank0_first import run_rank0_first

    out: dict = {}
    train, valid, _ = build_gpt_datasets([prefix], "8,2,0", 16, 7, (40, 4, 0), cache_dir)
    out["train_len"] = len(train)
    out["shuffle"] = np.asarray(train.shuffle_idx).tolist()
    loader = build_data_loader(train, 4, 2, rank, world_size)
    out["batches"] = [b.tolist() for b in loader]

    try:  # rank 0 fails: it re-raises its own error, the others get a clear RuntimeError
        build_gpt_datasets([prefix + "_missing"], "1", 16, 7, (4, 0, 0), cache_dir)
        out["missing"] = "no error"
    except Exception as e:
        out["missing"] = f"{type(e).__name__}: {e}"

    def slow_on_rank0():
        if rank == 0:
            time.sleep(4)
        return rank

    t0 = time.monotonic()
    try:
        run_rank0_first(slow_on_rank0, "a slow build", timeout_s=1.5)
        out["slow"] = "no error"
    except Exception as e:
        out["slow"] = f"{type(e).__name__}: {e}"
    out["slow_s"] = time.monotonic() - t0
    return out
