"""Exact resume with dropout on (issue 13 item 1).

Building a data-loader iterator used to take a draw from the global CPU generator that dropout
also uses, so a resumed run (which builds a new iterator after restoring the RNG) or a run with
another ``--eval-interval`` drew other dropout masks. Right value: bitwise-equal training losses
(fp32 on CPU, same arithmetic in the same order) after a resume at tp1 x dp2 and tp2 x dp2, ZeRO-1
and ZeRO-3, and training losses independent of how often evaluation runs.
"""

from __future__ import annotations

import pytest

from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs

MOCK = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
        "--log-interval", "1", "--eval-iters", "1", "--seed", "5"]


def train_losses(history) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in history if "split" not in r}


def resume_runs(directory, tp: int, stage: int) -> list[list[str]]:
    grid = ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage)]
    ck = str(directory / f"ck_tp{tp}_z{stage}")
    return [MOCK + grid + ["--train-iters", "8", "--eval-interval", "1000"],           # straight
            MOCK + grid + ["--train-iters", "4", "--eval-interval", "1000", "--save", ck],
            MOCK + grid + ["--train-iters", "8", "--eval-interval", "1000", "--load", ck],
            # eval every step
            MOCK + grid + ["--train-iters", "8", "--eval-interval", "1"]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["tp1_dp2", "tp2_dp2"])
def test_resume_with_dropout_is_bitwise_and_independent_of_eval_interval(tmp_path, world, tp):
    argvs = resume_runs(tmp_path, tp, 1) + resume_runs(tmp_path, tp, 3)
    histories = spawn_world(world, run_configs, argvs, timeout_s=120)[0]
    for stage, (straight, first, resumed, evaluated) in zip((1, 3), (histories[:4], histories[4:]),
                                                            strict=True):
        straight, first, resumed = (train_losses(straight), train_losses(first),
                                    train_losses(resumed))
        assert sorted(resumed) == [5, 6, 7, 8], stage
        assert {i: straight[i] for i in range(1, 5)} == first, stage
        assert {i: straight[i] for i in range(5, 9)} == resumed, stage  # bitwise
        assert train_losses(evaluated) == straight, stage


def test_building_a_loader_iterator_leaves_the_global_generator_alone():
    import torch

    from data.loader import build_data_loader
    from data.mock_dataset import MockGPTDataset, MockLowLevelDataset

    dataset = MockGPTDataset(MockLowLevelDataset(10, 9), "100,0,0", 0, 16, 4, seed=0)
    before = torch.get_rng_state()
    for consumed in (0, 8):
        next(iter(build_data_loader(dataset, consumed, 2, 1, 2)))
    assert torch.equal(torch.get_rng_state(), before)
