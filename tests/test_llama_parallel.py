"""Llama-style models through the CLI on every grid, ZeRO stage and activation mode, against one
process (issue 23 acceptance).

Tiny Llama configs (RoPE, RMSNorm, SwiGLU, GQA with G in {1, 2, 4}, no biases, untied output;
also ``--add-qkv-bias`` with ``--rotary-percent 0.5``, and ``--qk-layernorm`` with interleaved,
Llama-3.1-scaled RoPE) train 4 steps on mock data in fp32. The training losses of every
(tp, dp, stage, SP, recompute) run equal the single-process run of the same config to 1e-5
(absolute, on losses ~7: the same arithmetic split over ranks differs only in summation order,
~1e-7 here). With dropout on, stages 0-3 on the same grid give the same losses. A tp2 x dp2
ZeRO-3 checkpoint resumed at tp1 x dp4 ZeRO-1 continues exactly as the uninterrupted run. Three
spawned worlds (1, 2 and 4 ranks) run all of it.
"""

from __future__ import annotations

import pytest

from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "1",
        "--lr-decay-iters", "4", "--train-iters", "4", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1", "--seed", "5"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--ffn-hidden-size", "96", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
CONFIGS = {
    "g2": LLAMA + ["--num-query-groups", "2"],
    "g1": LLAMA + ["--num-query-groups", "1"],
    "g4": LLAMA + ["--num-query-groups", "4"],
    "qkv_bias": LLAMA + ["--num-query-groups", "2", "--add-qkv-bias", "--rotary-percent", "0.5"],
    "qk_norm": LLAMA + ["--num-query-groups", "2", "--qk-layernorm", "--rotary-interleaved",
                        "--use-rope-scaling", "--rotary-base", "500000"],
}
SP, SEL = ["--sequence-parallel"], ["--recompute-granularity", "selective"]
FULL = ["--recompute-granularity", "full"]
PA = FULL + ["--partition-activations", "--checkpoint-in-cpu", "--contiguous-checkpointing"]
# (config, tp, stage, extra flags) per world size; dp = world / tp. Only what the combination
# test (tests/test_combinations.py: every pair of tp, SP, ZeRO stage, recompute, P_a, GQA, biases,
# RoPE layout, QK-norm, ... against the plain model) does not hold: one query group (MQA), two
# groups split over tp 2, --rotary-percent 0.5, Llama-3.1 RoPE scaling and a 2-rank world.
GRIDS = {
    2: [("g2", 2, 0, SP + FULL), ("qk_norm", 2, 2, SP)],
    4: [("g2", 2, 3, SP + SEL), ("g2", 2, 2, SP + PA), ("g1", 1, 3, SEL), ("g4", 2, 2, SP),
        ("qkv_bias", 2, 1, SP + SEL), ("qk_norm", 2, 3, FULL), ("qk_norm", 2, 1, SP + SEL)],
}
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def argv(config: str, tp: int, stage: int, extra: list[str], dropout: bool = False) -> list[str]:
    return (BASE + CONFIGS[config] + (DROPOUT if dropout else NO_DROPOUT) + extra
            + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage)])


def train_losses(history) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in history if "split" not in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ck = str(tmp_path_factory.mktemp("llama_ck") / "ck")
    refs = spawn_world(1, run_configs, [argv(c, 1, 0, []) for c in CONFIGS], timeout_s=120)[0]
    two = spawn_world(2, run_configs, [argv(*g) for g in GRIDS[2]], timeout_s=120)[0]
    dropout = [argv("qk_norm", 2, stage, SP + SEL, dropout=True) for stage in range(4)]
    resume = [argv("g2", 2, 3, ["--train-iters", "2", "--save", ck]),
              argv("g2", 1, 1, ["--load", ck])]
    four = spawn_world(4, run_configs, [argv(*g) for g in GRIDS[4]] + dropout + resume,
                       timeout_s=120)[0]
    n = len(GRIDS[4])
    return dict(refs=dict(zip(CONFIGS, refs, strict=True)), two=two, four=four[:n],
                dropout=four[n:n + 4], resume=four[n + 4:], ck=ck)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_every_grid_matches_one_process(runs, world):
    got = runs["two" if world == 2 else "four"]
    for (config, tp, stage, extra), history in zip(GRIDS[world], got, strict=True):
        want = train_losses(runs["refs"][config])
        assert sorted(want) == [1, 2, 3, 4]
        assert train_losses(history) == pytest.approx(want, abs=1e-5), (config, tp, stage, extra)


@pytest.mark.timeout(900)
def test_with_dropout_every_stage_gives_the_same_losses(runs):
    first, *others = (train_losses(h) for h in runs["dropout"])
    assert sorted(first) == [1, 2, 3, 4]
    for stage, losses in enumerate(others, 1):
        assert losses == pytest.approx(first, abs=1e-5), stage
    undropped = train_losses(runs["four"][GRIDS[4].index(("qk_norm", 2, 1, SP + SEL))])
    assert max(abs(first[i] - undropped[i]) for i in first) > 1e-4  # dropout is on


@pytest.mark.timeout(900)
def test_resume_tp2_zero3_resharded_to_tp1_dp4_zero1_is_exact(runs):
    saved, resumed = (train_losses(h) for h in runs["resume"])
    want = train_losses(runs["refs"]["g2"])
    assert sorted(saved) == [1, 2] and sorted(resumed) == [3, 4]
    assert saved == pytest.approx({i: want[i] for i in (1, 2)}, abs=1e-5)
    assert resumed == pytest.approx({i: want[i] for i in (3, 4)}, abs=1e-5)


@pytest.mark.timeout(900)
def test_consolidated_llama_checkpoint_loads_strictly_into_the_plain_model(runs, tmp_path):
    import torch
    from safetensors.torch import load_file

    from hybrid.checkpoint.consolidate import main as consolidate_main
    from hybrid.checkpoint.directory import read_metadata
    from models.gpt import GPT, GPTConfig

    out = tmp_path / "llama.safetensors"
    assert consolidate_main(["--load", runs["ck"], "--output", str(out)]) == 0
    state = load_file(str(out))
    cfg = GPTConfig(**read_metadata(runs["ck"], 2)["model"])
    assert (cfg.swiglu, cfg.num_query_groups, cfg.normalization) == (True, 2, "RMSNorm")
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)
    assert state["layers.0.attn.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert {"lm_head.weight", "layers.1.mlp.gate.weight"} <= set(state)
    assert all(t.abs().sum() > 0 for t in state.values())
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 1000, (1, 32)))).all()
