"""Benchmark (not a test): preprocessing throughput on the embedded corpus at 1 and 2 workers.

    python scripts/bench_preprocess.py [--workers 1 2] [--repeat 3] [--copies 4]

Builds the stdlib corpus and a 8000-id tokenizer in a temporary directory, concatenates
``--copies`` copies of the corpus (so process start-up does not dominate), and prints the best
of ``--repeat`` runs per worker count: documents/s and tokens/s of ``data.preprocess``
(dataset load excluded; tokenization, Arrow round trip and ``.bin/.idx`` writing included).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402

from data.build_corpus import build_corpus  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from data.train_tokenizer import train_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    a = p.parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        docs, nbytes = build_corpus(d / "one.jsonl")
        lines = (d / "one.jsonl").read_text(encoding="utf-8")
        (d / "corpus.jsonl").write_text(lines * a.copies, encoding="utf-8")
        texts = [json.loads(x)["text"] for x in lines.splitlines()]
        train_tokenizer(texts, d / "tok", a.vocab_size)
        print(
            f"corpus: {docs * a.copies} documents, {nbytes * a.copies / 1e6:.1f} MB; vocab "
            f"{a.vocab_size}"
        )
        preprocess(
            [str(d / "corpus.jsonl")],
            d / "warm",
            d / "tok.model",
            progress=False,
            cache_dir=str(d / "hf"),
        )
        for w in a.workers:
            best = None
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                s = preprocess(
                    [str(d / "corpus.jsonl")],
                    d / f"w{w}",
                    d / "tok.model",
                    workers=w,
                    append_eod=True,
                    progress=False,
                    cache_dir=str(d / "hf"),
                )
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            print(
                f"workers={w}: {s.tokens} tokens in {best:.2f} s -> {s.tokens / best:,.0f} "
                f"tokens/s, {s.rows / best:,.0f} docs/s"
            )


if __name__ == "__main__":
    main()
