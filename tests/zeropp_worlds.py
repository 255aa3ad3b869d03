"""World functions of the ZeRO++ hpZ / qwZ tests (importable by spawned processes).

4 CPU ranks act as 2 "nodes" of 2 (``HYBRID_LOCAL_WORLD_SIZE=2``) or one node of 4, set per
case before the engine is built (the ledger and the groups read it then). Engine cases train the
tiny GPT (:mod:`tests.tiny`, dropout 0.1) for a few steps of 2 micro-batches and return the
losses, the updated parameters and the ledger's per-node bytes of each step; CLI cases run
``hybrid.pretrain`` (:func:`tests.pretrain_worlds.run_configs`).
"""

from __future__ import annotations

import os

import torch

from hybrid.parallel.grid import ProcessGrid
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from hybrid.zero.topology import NODE_SIZE_ENV
from tests.pretrain_worlds import run_configs
from tests.tiny import build_parallel, make_batch, tiny_config

CFG = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
STEPS, MICRO = 2, 2


def train(grid: ProcessGrid, zero: ZeroConfig, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps of the tiny GPT under ``zero``; losses (floats, this rank),
    per-step ``node_bytes``, the parameters after the last step (full, by name) and
    ``memory_bytes``."""
    engine = build_parallel(grid, CFG, zero, OptimizerConfig(lr=3e-3))
    torch.manual_seed(7 + grid.dp_rank)  # dropout masks: same in every run of this rank
    losses, nodes = [], []
    for step in range(steps):
        for m in range(MICRO):
            x, y = make_batch(100 * step + 10 * m + grid.dp_rank, 2, 16, CFG["vocab_size"])
            loss = engine.model(x, y).mean() / MICRO
            engine.backward(loss, is_last_micro_batch=m == MICRO - 1)
            losses.append(loss.item())
        nodes.append(engine.step(3e-3).node_bytes)
    params = {k: v.float().clone() for k, v in engine.model_state_dict_full().items()}
    memory = engine.memory_bytes()
    engine.close()
    return dict(losses=losses, nodes=nodes, params=params, memory=memory,
                numel=engine.layout.numel, padded=engine.layout.total_numel)


def engine_cases(rank: int, world: int, cases: list[tuple[str, int, int, dict]]) -> dict:
    """Per case ``(name, node size, tp, ZeroConfig kwargs)``: :func:`train`'s result, or the
    message of the ``ValueError`` the engine raised."""
    grids: dict[int, ProcessGrid] = {}
    out = {}
    for name, node, tp, kw in cases:
        os.environ[NODE_SIZE_ENV] = str(node)
        grid = grids.setdefault(tp, ProcessGrid(tp=tp))
        try:
            out[name] = train(grid, ZeroConfig(stage=3, param_persistence_threshold=0, **kw))
        except ValueError as e:
            out[name] = str(e)
    return out


def mixed(rank: int, world: int, cases: list, node: int, argvs: list[list[str]]) -> dict:
    """:func:`engine_cases` of ``cases``, then ``hybrid.pretrain`` on each of ``argvs`` with
    ``node`` processes per node."""
    out = engine_cases(rank, world, cases)
    os.environ[NODE_SIZE_ENV] = str(node)
    out["cli"] = run_configs(rank, world, argvs)
    return out
