"""Seeded initialisation of one TP shard, block by block, equals the shard of the full draw.

``hybrid.parallel.tp_weights.seeded_shard`` never holds a whole parameter: it draws the full weight
from the parameter's generator in blocks of 16-row multiples and keeps its shard. That is exact
only because torch's CPU ``normal_`` draws uniforms in order and transforms aligned groups of 16
(redrawing the last 16 when the size is not a multiple of 16); this test holds it to bitwise
equality with ``GPT.init_weights(seed)``'s full draw for both split dimensions, padded
vocabularies, sizes that are not multiples of 16, and blocks from 16 rows to the whole tensor,
so a torch change to ``normal_`` fails here rather than in parity tests far away.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel.tp_spec import TPSpec
from hybrid.parallel.tp_weights import seeded_shard
from models.gpt import GPTConfig, init_parameter, parameter_generator

CONFIG = GPTConfig(num_layers=3, hidden_size=24, num_attention_heads=4, vocab_size=101,
                   max_position_embeddings=40)


def full_draw(name: str, shape: tuple[int, int]) -> torch.Tensor:
    full = torch.empty(shape)
    init_parameter(name, full, CONFIG, parameter_generator(7, name))
    return full


@pytest.mark.parametrize("name,shape,split_dim,padded", [
    ("wte.weight", (101, 24), 0, 104),            # padded vocabulary, rows split
    ("wte.weight", (1003, 17), 0, 1004),          # 17051 elements: not a multiple of 16
    ("layers.0.attn.qkv.weight", (72, 24), 0, 72),
    ("layers.0.attn.proj.weight", (24, 24), 1, 24),  # columns split, scaled std
    ("layers.1.mlp.fc2.weight", (41, 97), 1, 100),   # odd sizes, columns split with padding
    ("wpe.weight", (40, 24), None, 0),            # replicated: drawn whole
])
@pytest.mark.parametrize("chunk", [16, 300, 4096, 1 << 24])
def test_seeded_shard_equals_full_draw(name, shape, split_dim, padded, chunk):
    full = full_draw(name, shape)
    tp_sizes = [1] if split_dim is None else [1, 2, 4]
    for tp in tp_sizes:
        for rank in range(tp):
            spec = TPSpec(split_dim, shape, padded, rank, tp)
            got = seeded_shard(name, spec, CONFIG, 7, chunk_elements=chunk)
            want = spec.shard(full)
            assert got.shape == want.shape
            assert torch.equal(got, want), (name, tp, rank, chunk)


def test_seeded_shard_holds_one_block():
    """Drawing rank 0's shard of a large embedding allocates blocks, never the full tensor."""
    shape, tp = (4096, 64), 4
    spec = TPSpec(0, shape, 4096, 0, tp)
    sizes = []
    real_empty = torch.empty

    def spy(*args, **kw):
        t = real_empty(*args, **kw)
        sizes.append(t.numel())
        return t

    torch.empty = spy
    try:
        seeded_shard("wte.weight", spec, CONFIG, 7, chunk_elements=4096)
    finally:
        torch.empty = real_empty
    assert max(sizes) <= 4096
    # each block is allocated twice (the block and init_parameter's draw); rank 0 stops after
    # its last row, so a quarter of the rows is drawn
    assert sum(sizes) == 2 * 4096 * 64 // tp
