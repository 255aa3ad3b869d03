"""The data-parallel loader, and index building on a real 2-rank world."""

from __future__ import annotations

import pytest
import torch
from data_helpers import world_build_and_load, write_token_dataset

from data.gpt_dataset import build_gpt_datasets
from data.loader import PretrainingSampler, build_data_loader
from hybrid.parallel.spawn import spawn_world


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    docs = [list(range(i, i + 5 + i % 13)) for i in range(60)]
    prefix = write_token_dataset(d / "d", docs)
    return build_gpt_datasets(str(prefix), "1", 8, 0, (103, 0, 0))[0]


def test_ranks_get_disjoint_slices_and_equal_counts():
    total, dp, mbs = 103, 3, 4
    per_rank = [list(PretrainingSampler(total, 5, mbs, r, dp)) for r in range(dp)]
    assert {len(b) for b in per_rank} == {(total - 5) // (mbs * dp)}
    flat = [i for r in range(dp) for b in per_rank[r] for i in b]
    assert len(flat) == len(set(flat))
    steps = list(zip(*per_rank, strict=True))
    for g, step in enumerate(steps):  # global micro-batch g = contiguous block, ranks in order
        assert sum(step, []) == list(range(5 + g * 12, 5 + (g + 1) * 12))
    for bad in [(10, 11, 1, 0, 1), (10, 0, 0, 0, 1), (10, 0, 1, 2, 2), (10, -1, 1, 0, 1)]:
        with pytest.raises(ValueError):
            PretrainingSampler(*bad)


def test_loader_batches_resume_and_tp_copies(train):
    full = [b for b in build_data_loader(train, 0, 2, 1, 2)]
    assert full[0].shape == (2, 9) and full[0].dtype == torch.int64
    assert len(full) == len(train) // 4
    assert torch.equal(full[0][1], train[3]["tokens"])  # rank 1 of global batch 0: samples 2, 3
    resumed = list(build_data_loader(train, 12, 2, 1, 2))  # 3 global micro-batches consumed
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[3:], strict=True))
    tp_copy = list(
        build_data_loader(train, 0, 2, 1, 2, num_workers=1)
    )  # same dp rank, other TP rank
    assert all(torch.equal(a, b) for a, b in zip(tp_copy, full, strict=True))
    other = list(build_data_loader(train, 0, 2, 0, 2))
    assert not any(torch.equal(a, b) for a, b in zip(other, full, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_world_builds_once_and_never_hangs(tmp_path):
    docs = [list(range(i, i + 3 + i % 7)) for i in range(40)]
    prefix = str(write_token_dataset(tmp_path / "d", docs))
    r0, r1 = spawn_world(2, world_build_and_load, prefix, str(tmp_path / "cache"), timeout_s=60)
    assert r0["train_len"] == r1["train_len"] and r0["shuffle"] == r1["shuffle"]
    assert len(r0["batches"]) == len(r1["batches"]) > 0
    assert not {tuple(map(tuple, b)) for b in r0["batches"]} & {
        tuple(map(tuple, b)) for b in r1["batches"]
    }
    assert (
        len(list((tmp_path / "cache").glob("*-GPTDataset-*.npy"))) == 6
    )  # train + valid, built once
    assert r0["missing"].startswith("FileNotFoundError") and "_missing" in r0["missing"]
    assert r1["missing"].startswith("RuntimeError: rank 0 failed to build GPT dataset indices")
    assert (
        r1["slow"].startswith("TimeoutError")
        and "waited up to 1.5 s for rank 0 to build a slow build" in r1["slow"]
    )
    assert r1["slow_s"] < 10
    assert r0["slow"].startswith("TimeoutError")  # rank 0 learns that its peer gave up
    assert len(r0["batches"][0]) == 2
