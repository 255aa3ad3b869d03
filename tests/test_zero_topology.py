"""Which data-parallel ranks share a node (:mod:`hybrid.zero.topology`), without processes."""

from __future__ import annotations

import pytest

from hybrid.zero.topology import NODE_SIZE_ENV, NodeTopology, local_world_size


def test_groups_tp2_two_nodes_of_four():
    t = NodeTopology(world_size=8, tp=2, local=4)
    assert (t.dp, t.nodes, t.dp_per_node) == (4, 2, 2)
    assert t.intra_node_groups(2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert t.inter_node_groups(2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert t.groups_of(6, 2) == ([4, 6], [2, 6])
    for g in t.intra_node_groups(2):
        assert not t.spans_nodes(g)
    for g in t.inter_node_groups(2):
        assert t.spans_nodes(g)


def test_groups_tp1_and_partial_node():
    t = NodeTopology(world_size=4, tp=1, local=2)  # 4 CPU ranks as 2 nodes of 2
    assert t.intra_node_groups(2) == [[0, 1], [2, 3]]
    assert t.inter_node_groups(2) == [[0, 2], [1, 3]]
    t = NodeTopology(world_size=16, tp=1, local=8)  # intra groups of 4 inside 8-rank nodes
    assert t.intra_node_groups(4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                      [12, 13, 14, 15]]
    assert t.inter_node_groups(4)[0] == [0, 4, 8, 12]


def test_every_rank_in_exactly_one_group_of_each_kind():
    t = NodeTopology(world_size=32, tp=4, local=8)
    for groups in (t.intra_node_groups(2), t.inter_node_groups(2)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(32))
    for rank in range(32):  # an intra group lies inside rank's data-parallel group
        intra, inter = t.groups_of(rank, 2)
        assert {r % 4 for r in intra + inter} == {rank % 4}
        assert set(intra) & set(inter) == {rank}


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="valid sizes: \\[1\\]"):
        NodeTopology(world_size=8, tp=4, local=4).check_intra_size(2)  # tp fills the node
    with pytest.raises(ValueError, match="do not divide the world size 6"):
        NodeTopology(world_size=6, tp=1, local=4)
    with pytest.raises(ValueError, match="tensor-model-parallel size 4 does not divide"):
        NodeTopology(world_size=8, tp=4, local=2)


def test_local_world_size_override(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv(NODE_SIZE_ENV, raising=False)
    assert local_world_size(8) == 4
    monkeypatch.setenv(NODE_SIZE_ENV, "2")
    assert local_world_size(8) == 2
    assert local_world_size(1) == 1
    monkeypatch.setenv(NODE_SIZE_ENV, "two")
    with pytest.raises(ValueError, match="HYBRID_LOCAL_WORLD_SIZE='two'"):
        local_world_size(8)
