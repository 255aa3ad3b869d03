"""``--mock-data`` is Megatron-LM's mock dataset (issue 36): its documents, packed and shuffled
by ``--seed`` as ``GPTDataset``; the same seed gives the same samples, and the README's first run
learns from it (the loss falls by at least 20% in its 50 iterations)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from data.mock_dataset import MockGPTDataset, MockLowLevelDataset
from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs


def megatron_document(i: int, vocab: int, eod: int) -> np.ndarray:
    """Megatron-LM's ``MockGPTLowLevelDataset[i]``, written out from its definition."""
    length = np.random.default_rng(seed=0).integers(low=1, high=4096, size=100000,
                                                    dtype=np.int32)[i]
    return np.int64(np.concatenate([(np.arange(length - 1) + 1) % vocab, [eod]]))


def test_documents_are_megatrons():
    low = MockLowLevelDataset(512, 511)
    for i in (0, 1, 7, 99_999, int(np.argmin(low.sizes)), int(np.argmax(low.sizes))):
        np.testing.assert_array_equal(low.get(i), megatron_document(i, 512, 511))
        if low.sizes[i] >= 8:
            np.testing.assert_array_equal(low.get(i, 3, 5), megatron_document(i, 512, 511)[3:8])


def test_same_seed_same_samples_and_the_stream_is_the_shuffled_documents():
    low = MockLowLevelDataset(512, 511)
    a, b = (MockGPTDataset(low, "99,1,0", 0, 40, 64, seed=5) for _ in range(2))
    c = MockGPTDataset(low, "'99,1,0'", 0, 40, 64, seed=6)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(40))
    assert not all(torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(40))
    stream = np.concatenate([low.get(int(d)) for d in a.doc_idx[:3]])
    np.testing.assert_array_equal(a.unshuffled_tokens(0), stream[:65])
    valid = MockGPTDataset(low, "99,1,0", 1, 4, 64, seed=5)
    assert valid.doc_idx.min() >= 99_000  # the split is by document, the last 1% for validation


def readme_first_run() -> list[str]:
    """The flags of the README's first run (its ``python -m hybrid.pretrain`` command)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"python -m hybrid\.pretrain --nproc-per-node 2 (--mock-data.*?)\n```",
                      text, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    save = argv.index("--save")
    return argv[:save] + argv[save + 2:]


@pytest.mark.timeout(300)
def test_the_readme_first_run_learns_from_mock_data():
    argv = readme_first_run() + ["--log-interval", "1"]
    assert argv.count("--train-iters") == 1 and argv[argv.index("--train-iters") + 1] == "50"
    history = spawn_world(2, run_configs, [argv], timeout_s=120)[0][0]
    losses = [r["lm_loss"] for r in history if "split" not in r]
    assert len(losses) == 50 and losses[0] == pytest.approx(np.log(512), abs=0.15)
    assert losses[-1] <= 0.8 * losses[0], losses
