"""Which tensor-parallel sizes a model and cluster allow: the planner's candidates and the
one-line refusal of a bad ``--tp`` that lists the valid ones (the split rule is
:func:`hybrid.parallel.tp_split.tp_split_refusal`, the grid rule
:func:`hybrid.parallel.grid.validate_grid`)."""

from __future__ import annotations

from hybrid.parallel.grid import validate_grid
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.planner.inputs import Cluster
from models.config import GPTConfig


def tp_candidates(model: GPTConfig, cluster: Cluster) -> list[int]:
    """Powers of two t <= gpus_per_node over which the model splits (heads, K/V groups, MLP
    width: :func:`hybrid.parallel.tp_split.tp_split_refusal`) and the grid forms."""
    out, t = [], 1
    while t <= cluster.gpus_per_node:
        if tp_split_refusal(model, t) is None and grid_refusal(t, cluster) is None:
            out.append(t)
        t *= 2
    return out


def grid_refusal(tp: int, cluster: Cluster) -> str | None:
    """Why ``tp`` makes no grid of the cluster (:func:`hybrid.parallel.grid.validate_grid`: tp
    divides the GPUs and fits in a node), or None."""
    try:
        validate_grid(cluster.num_gpus, tp, cluster.gpus_per_node)
    except ValueError as e:
        return str(e)
    return None


def valid_tps(m: GPTConfig, cluster: Cluster) -> list[int]:
    """Every tp that splits ``m`` and makes a grid of ``cluster``."""
    return [t for t in range(1, cluster.num_gpus + 1)
            if tp_split_refusal(m, t) is None and grid_refusal(t, cluster) is None]


def check_tp(m: GPTConfig, tp: int, cluster: Cluster) -> None:
    """Raises ValueError naming every rule ``tp`` breaks and the valid values of ``--tp``."""
    why = []  # every rule tp breaks, not the first only
    refusal = tp_split_refusal(m, tp) if tp > 0 else None
    if tp <= 0:
        why.append(f"tp={tp} must be positive")
    elif refusal is not None and refusal.dimension == "num_query_groups":
        why.append(f"tp={tp} must divide num_query_groups={m.query_groups} (each TP rank holds "
                   "whole K/V heads)")
    elif refusal is not None:
        why.append(f"tp={tp} must divide num_attention_heads={m.num_attention_heads} and "
                   f"ffn_hidden_size={m.ffn_hidden_size}")
    if tp > 0 and (grid := grid_refusal(tp, cluster)) is not None:
        why.append(grid.split("; valid tensor-model-parallel sizes")[0])  # the full list below
    if why:
        valid = ", ".join(map(str, valid_tps(m, cluster))) or "none"
        raise ValueError("; ".join(why) + f"; valid --tp for this model on {cluster.num_gpus} "
                         f"GPUs: {valid}")
