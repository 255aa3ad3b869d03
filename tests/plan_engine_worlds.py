"""World function for ``tests/test_plan_vs_engine.py`` (importable by spawned processes)."""

from __future__ import annotations

from hybrid.grid import ProcessGrid
from hybrid.plan_check import measure

# A small GPT: 2 blocks, h = 64, f = 126 (units are no multiple of dp * 8, so the layout pads);
# vocabulary 1000 (padded to 1024 by the TP plan).
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=126,
             vocab_size=1000, max_position_embeddings=32)


def world_measure(rank: int, world: int, runs) -> dict:
    """Measure every run (grouped by tp, one grid each); rank r returns {run.name: measured}."""
    out = {}
    for tp in sorted({r.tp for r in runs}):
        grid = ProcessGrid(tp=tp)
        for run in (r for r in runs if r.tp == tp):
            out[run.name] = measure(grid, run)
    return out
