"""One rule of whether a model splits over tp (``hybrid.parallel.tp_split``), used by the job's
checks, the TP plan, the planner's candidates and the FLOP arithmetic alike."""

import pytest

from hybrid.flops import parameters_per_tp_rank
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.planner.inputs import Cluster, Training
from hybrid.planner.plan import evaluate, tp_candidates
from models.config import GPTConfig

GQA = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                vocab_size=1024, max_position_embeddings=64, swiglu=True)


def test_the_rule_checks_heads_groups_ffn_vocab_and_sequence_in_order():
    assert tp_split_refusal(GQA, 2) is None
    r = tp_split_refusal(GQA, 4)
    assert (r.dimension, r.value, r.valid_tp()) == ("num_query_groups", 2, [1, 2])
    assert r.flag_message() == ("--num-query-groups 2 is not divisible by "
                                "--tensor-model-parallel-size 4: each TP rank holds whole K/V "
                                "heads; valid tp values: 1, 2")
    assert tp_split_refusal(GQA, 3).dimension == "num_attention_heads"
    assert tp_split_refusal(GQA, 2, vocab_size=1001).dimension == "vocab_size"
    r = tp_split_refusal(GQA, 2, sequence_length=63)
    assert r.flag_message() == ("--sequence-parallel needs --seq-length divisible by "
                                "--tensor-model-parallel-size: 63 % 2 = 1")


def test_planner_candidates_obey_the_kv_group_rule():
    # before: tp 4 and 8 were candidates (heads and f divide) and evaluating them failed inside
    # the FLOP arithmetic; now they are not offered, and a given tp is refused by name
    cluster = Cluster(num_gpus=8)
    assert tp_candidates(GQA, cluster) == [1, 2]
    with pytest.raises(ValueError, match="tp=4 must divide num_query_groups=2"):
        evaluate(GQA, cluster, Training(seq_length=64), 4, 1, "none")
    with pytest.raises(ValueError, match="tp=4 does not divide num_query_groups=2"):
        parameters_per_tp_rank(GQA, 4)
