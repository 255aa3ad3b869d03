"""The stage plan and the gradient reducer's static plan, as pure functions (no process group).

A reduce-scatter is simulated in one process: every rank's staged input is built from its own
gradient through the plan's copies, the inputs are summed, and each rank keeps its chunk. The
result must be the sum over ranks of exactly the gradient elements the rank owns.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.zero.config import ZeroConfig
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.reduce import FlatCopy, GradCopy, reduce_plan
from hybrid.zero.stage import stage_plan

ENTRIES = [("a", (63,), True, True, "root"), ("b", (10, 7), False, False, "root"),
           ("c", (5,), True, True, "layers.0"), ("d", (33, 3), False, False, "layers.0"),
           ("e", (17, 2), False, False, "layers.1")]
UNITS = ["root", "layers.0", "layers.1"]


def layout(dp: int) -> PartitionLayout:
    return PartitionLayout(ENTRIES, UNITS, dp, align=8)


def flat_of(L: PartitionLayout, grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-parameter gradients as one zero-padded full-flat vector."""
    flat = torch.zeros(L.total_numel, dtype=torch.float64)
    for s, g in zip(L.slots, grads, strict=True):
        flat[s.offset:s.offset + s.numel] = g.reshape(-1)
    return flat


def owned(L: PartitionLayout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s shards of a full-flat vector, in partition order."""
    return torch.cat([flat[a:b] for a, b in (L.shard_range(u.index, rank) for u in L.units)])


@pytest.mark.parametrize("stage, grad_reduce, want", [
    (0, "reduce_scatter", (False, False, False, False, True, True)),
    (0, "all_reduce", (False, False, False, False, True, True)),
    (1, "reduce_scatter", (True, False, False, False, False, False)),
    (1, "all_reduce", (True, False, False, False, True, True)),
    (2, "reduce_scatter", (True, True, False, True, False, False)),
    (2, "all_reduce", (True, True, False, True, True, False)),
    (3, "reduce_scatter", (True, True, True, True, False, False)),
    (3, "all_reduce", (True, True, True, True, True, False)),
])
def test_stage_plan_decides_every_boolean(stage, grad_reduce, want):
    p = stage_plan(stage, grad_reduce, param_persistence_threshold=100)
    got = (p.shards_optimizer_states, p.shards_gradients, p.shards_parameters,
           p.reduce_every_micro_batch, p.grad_all_reduce, p.grad_in_place)
    assert got == want
    assert p.persistence_threshold == (100 if stage == 3 else 0)  # none persistent below 3
    zc = ZeroConfig(stage=stage, grad_reduce=grad_reduce, param_persistence_threshold=100)
    assert zc.plan == p
    with pytest.raises(AttributeError):
        p.stage = 1


def test_stage_plan_refuses_unknown_values():
    with pytest.raises(ValueError, match="ZeRO stage must be one of"):
        stage_plan(4)
    with pytest.raises(ValueError, match="grad_reduce"):
        stage_plan(1, "all_gather")


@pytest.mark.parametrize("stage, grad_reduce", [(0, "reduce_scatter"), (1, "all_reduce")])
@pytest.mark.parametrize("dp, bucket", [(1, 1000), (2, 7), (3, 64)])
def test_in_place_plan_tiles_the_full_flat_buffer_last_block_first(stage, grad_reduce, dp, bucket):
    L = layout(dp)
    rp = reduce_plan(L, stage_plan(stage, grad_reduce), dp, 0, bucket)
    assert rp.chunk == 0
    assert [(b.start, b.end) for b in rp.buckets] == list(L.flat_buckets(bucket))
    assert rp.buckets[0].end == L.total_numel and rp.buckets[-1].start == 0
    for b in rp.buckets:
        assert b.copy_in == () and b.copy_out == ()
        assert b.units == tuple(u.index for u in L.units
                                if u.offset < b.end and b.start < u.offset + u.padded)
    assert rp.unit_buckets == tuple(sum(u.index in b.units for b in rp.buckets) for u in L.units)


def _simulate(L, plans, grads_of_rank, stage):
    """Each rank's reduced result through its plan ``plans[rank]``: the full flat buffer
    (stage 1, only the owned shards written) or the partition buffer (stages 2/3)."""
    dp, rp = len(plans), plans[0]
    results = [torch.zeros(L.total_numel if stage == 1 else L.partition_numel, dtype=torch.float64)
               for _ in range(dp)]
    for i, bucket in enumerate(rp.buckets):
        n = bucket.end - bucket.start
        assert n <= rp.chunk
        summed = torch.zeros(dp * n, dtype=torch.float64)
        for r in range(dp):
            inp, flat = torch.zeros(dp * n, dtype=torch.float64), flat_of(L, grads_of_rank[r])
            for c in bucket.copy_in:
                if isinstance(c, FlatCopy):
                    inp[c.dst:c.dst + c.length] = flat[c.src:c.src + c.length]
                else:
                    g = grads_of_rank[r][c.param].reshape(-1)
                    inp[c.dst:c.dst + c.length] = g[c.param_start:c.param_start + c.length]
            summed += inp
        for r in range(dp):
            mine, out = plans[r].buckets[i], summed[r * n:(r + 1) * n]
            if stage == 1:
                for c in mine.copy_out:
                    results[r][c.dst:c.dst + c.length] = out[c.src:c.src + c.length]
            else:
                results[r][bucket.start:bucket.end] += out
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp, bucket", [(1, 5), (2, 16), (3, 48), (4, 10_000)])
def test_staged_plan_reduce_scatters_exactly_the_owned_gradient(stage, dp, bucket):
    L = layout(dp)
    plan = stage_plan(stage)
    plans = [reduce_plan(L, plan, dp, r, bucket) for r in range(dp)]
    rp = plans[0]
    assert rp.chunk == min(max(1, bucket // dp), L.partition_numel)
    assert [(b.start, b.end) for b in rp.buckets] == list(L.reduce_buckets(rp.chunk))
    gen = torch.Generator().manual_seed(dp * 10 + stage)
    grads = [[torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in L.slots]
             for _ in range(dp)]
    total = sum(flat_of(L, g) for g in grads)
    results = _simulate(L, plans, grads, stage)
    for r in range(dp):
        if stage == 1:
            torch.testing.assert_close(owned(L, results[r], r), owned(L, total, r), rtol=0, atol=0)
        else:
            torch.testing.assert_close(results[r], owned(L, total, r), rtol=0, atol=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_staged_plan_copies_cover_the_input_once_and_only_real_elements(stage):
    dp, bucket = 3, 30
    L = layout(dp)
    rp = reduce_plan(L, stage_plan(stage), dp, 1, bucket)
    kind = FlatCopy if stage == 1 else GradCopy
    for b in rp.buckets:
        n = b.end - b.start
        hits = torch.zeros(dp * n, dtype=torch.int64)
        for c in b.copy_in:
            assert isinstance(c, kind)
            hits[c.dst:c.dst + c.length] += 1
            if isinstance(c, GradCopy):  # never past the parameter's end
                assert c.param_start + c.length <= L.slots[c.param].numel
        assert hits.max() <= 1
        if stage == 1:  # the full flat copy includes the padding: every element once
            assert bool((hits == 1).all())
        assert sum(c.length for c in b.copy_out) == n
    # every rank issues the same collectives: only where the result goes back differs
    other = reduce_plan(L, stage_plan(stage), dp, 2, bucket)
    assert [(b.start, b.end, b.units, b.copy_in) for b in rp.buckets] == \
        [(b.start, b.end, b.units, b.copy_in) for b in other.buckets]
    assert rp.unit_buckets == other.unit_buckets
    assert all(c > 0 for c in rp.unit_buckets)
