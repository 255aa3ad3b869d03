"""The embedded corpus and the end-to-end data script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.build_corpus import build_corpus, module_document
from data.indexed_dataset import IndexedDataset
from data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_corpus_is_deterministic_real_text(tmp_path):
    n1, b1 = build_corpus(tmp_path / "a.jsonl", max_bytes=200_000)
    n2, b2 = build_corpus(tmp_path / "b.jsonl", max_bytes=200_000)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (n1, b1) == (n2, b2) and n1 >= 10 and 150_000 < b1 <= 200_000
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[0]["module"] == "abc" and rows[0]["text"].startswith(
        "Module abc\n\nAbstract Base Classes"
    )
    assert all(r["text"].strip() for r in rows)


def test_module_document_parses_without_importing(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""Top."""\nraise SystemExit\nclass K:\n    """Kdoc."""\n    def f(self, x=1):\n'
        '        """Fdoc."""\n    def _p(self):\n        """hidden"""\n'
    )
    assert (
        module_document(src, "m")
        == "Module m\n\nTop.\n\nclass m.K\n\nKdoc.\n\nm.K.f(self, x=1)\n\nFdoc."
    )


@pytest.mark.timeout(120)
def test_preprocess_data_script_end_to_end(tmp_path):
    env = dict(
        os.environ, PYTHON=sys.executable, DATA_DIR=str(tmp_path), VOCAB_SIZE="700", WORKERS="1"
    )
    corpus = tmp_path / "stdlib_docs.jsonl"
    build_corpus(corpus, max_bytes=100_000)  # small, so the test stays fast; the script reuses it
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "preprocess_data.sh"), "--no-progress"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ds = IndexedDataset(tmp_path / "stdlib_text_document")
    tok = Tokenizer(tmp_path / "tokenizer.model")
    first = json.loads(corpus.read_text(encoding="utf-8").splitlines()[0])["text"]
    assert tok.decode(ds[0][:-1].tolist()) == first and ds[0][-1] == tok.eod


def test_preprocess_data_script_passes_the_tokenizer_type(tmp_path):
    """Megatron-LM's preprocess_data.py needs --tokenizer-type; the script passed none (and
    could not take a Hugging Face tokenizer). The commands it runs, seen through a stand-in
    interpreter that records its arguments."""
    record = tmp_path / "args"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    fake.chmod(0o755)
    (tmp_path / "stdlib_docs.jsonl").write_text("{}\n")
    (tmp_path / "tokenizer.model").write_text("")
    script = ["bash", str(ROOT / "scripts" / "preprocess_data.sh")]
    env = dict(os.environ, PYTHON=str(fake), DATA_DIR=str(tmp_path))
    subprocess.run(script, env=env, cwd=ROOT, check=True, timeout=60)
    sp = tmp_path / "tokenizer.model"
    assert f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {sp} " in record.read_text()
    record.unlink()
    hf = tmp_path / "hf_tok"
    subprocess.run(script, env=dict(env, TOKENIZER_TYPE="HuggingFaceTokenizer", TOKENIZER=str(hf)),
                   cwd=ROOT, check=True, timeout=60)
    (line,) = record.read_text().splitlines()  # no tokenizer training for a given HF one
    assert line.startswith("-m data.preprocess ") and \
        f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf} " in line
