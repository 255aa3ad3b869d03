"""World functions for the Llama activation-memory tests (spawned ranks; importable)."""

from __future__ import annotations

import torch

from hybrid.activation.apply import ActivationConfig, apply_activation_checkpointing
from hybrid.activation.saved_bytes import measure_saved_bytes
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt
from models.gpt import GPT, GPTConfig

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=1001, max_position_embeddings=32,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True)
MODELS = {"llama": LLAMA, "qk_norm": dict(LLAMA, qk_layernorm=True)}
B, S = 2, 16
MODES = {"none": None, "selective": dict(recompute_granularity="selective"),
         "full": dict(checkpoint_activations=True)}


def _saved(grid: ProcessGrid, kw: dict, dropout: float, sp: bool, mode: str) -> dict:
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**dict(kw, hidden_dropout=dropout, attention_dropout=dropout)))
    tracker = RNGTracker(seed=77, tp_rank=grid.tp_rank)
    parallelize_gpt(model, grid.tp_group, tracker=tracker, sequence_parallel=sp)
    model.to(torch.bfloat16)
    ac = MODES[mode]
    handle = None if ac is None else apply_activation_checkpointing(
        model, grid, ActivationConfig(**ac), tracker)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, kw["vocab_size"], (B, S + 1), generator=g)

    def step():
        model(x[:, :-1], x[:, 1:]).float().mean().backward()

    return measure_saved_bytes(step, model, handle)


def saved_bytes_world(rank: int, world: int, tps: list[int]) -> dict:
    """``{(tp, model, dropout, sp, mode, num_layers): saved-bytes record}`` of one bf16
    micro-batch, at 1 and 3 layers (their difference is two layers' bytes, without what the
    model saves once: embedding, loss, RoPE tables)."""
    out = {}
    for tp in tps:
        grid = ProcessGrid(tp=tp)
        for name, kw in MODELS.items():
            for dropout in (0.1, 0.0):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for mode in MODES:
                        for layers in (1, 3):
                            out[(tp, name, dropout, sp, mode, layers)] = _saved(
                                grid, dict(kw, num_layers=layers), dropout, sp, mode)
    return out
