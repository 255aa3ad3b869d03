"""World functions for the kernel-fusion tests (run inside spawned ranks; importable).

Every check builds the tiny model on the TP grid (``parallelize_gpt``, no ZeRO: the fused
kernels live in the model, the ZeRO stages never see them), sets every fusion on, and returns
the loss and the gathered full gradients of one micro-batch for the test to compare with the
single-process model.
"""

from __future__ import annotations

import torch

from hybrid.activation.apply import apply_activation_checkpointing
from hybrid.activation.config import ActivationConfig
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt
from hybrid.parallel.tp_weights import gather_full_state_dict
from models.fusion import KernelFusion, set_kernel_fusion
from models.gpt import GPT, GPTConfig
from tests.tiny import make_batch, tiny_config

GPT_KW = tiny_config()
LLAMA_KW = tiny_config(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                       add_bias_linear=False, num_query_groups=2, ffn_hidden_size=128)
CASES = {  # name: (config, sequence parallel, full recompute)
    "gpt_tp2_hidden_dropout": (dict(GPT_KW, hidden_dropout=0.1), False, False),
    "llama_tp2": (LLAMA_KW, False, False),
    "gpt_tp2_sp": (GPT_KW, True, False),
    "llama_tp2_sp": (LLAMA_KW, True, False),
    "gpt_tp2_sp_dropout": (dict(GPT_KW, hidden_dropout=0.1, attention_dropout=0.1), True,
                           False),
    "gpt_tp2_sp_dropout_recompute": (dict(GPT_KW, hidden_dropout=0.1, attention_dropout=0.1),
                                     True, True),
}
DATA_SEED, DROPOUT_SEED = 3, 77


def run_single(config_kw: dict, fused: bool) -> dict:
    """Loss and gradients of the single-process GPT (fused or eager) on the test batch."""
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**config_kw))
    set_kernel_fusion(model, KernelFusion.every(fused))
    x, y = make_batch(DATA_SEED)
    torch.manual_seed(DROPOUT_SEED)
    loss = model(x, y).mean()
    loss.backward()
    return dict(loss=loss.item(), grads={n: p.grad.clone() for n, p in model.named_parameters()})


def _parallel(grid: ProcessGrid, config_kw: dict, sp: bool, recompute: bool) -> dict:
    torch.manual_seed(1234)
    cfg = GPTConfig(**config_kw)
    model = GPT(cfg)
    tracker = RNGTracker(DROPOUT_SEED, grid.tp_rank)
    parallelize_gpt(model, grid.tp_group, tracker=tracker, sequence_parallel=sp)
    if recompute:
        apply_activation_checkpointing(model, grid, ActivationConfig(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            tracker)
    set_kernel_fusion(model, KernelFusion.every())
    x, y = make_batch(DATA_SEED)
    torch.manual_seed(DROPOUT_SEED)
    loss = model(x, y).mean()
    loss.backward()
    grads = gather_full_state_dict(model, grid.tp_group,
                                   {n: p.grad for n, p in model.named_parameters()})
    return dict(loss=loss.item(), grads=grads)


def fusion_world(rank: int, world_size: int) -> dict:
    """Every case of :data:`CASES` at tp = 2 (the whole world)."""
    grid = ProcessGrid(tp=world_size)
    return {name: _parallel(grid, kw, sp, rc) for name, (kw, sp, rc) in CASES.items()}
