"""ZeRO++ in the planner: hpZ's secondary parameter shard and qwZ's int8 parameter gathers
(arXiv 2306.10209 §3.1-3.2), counted as the engine runs them (``hybrid.zero.hpz``,
``hybrid.zero.qwz``). Stage 3 only; the other stages ignore both settings.

With ``Psi_g = Psi_t - Psi_p`` the gathered (non-persistent) elements of a rank's TP shard, ``m``
micro-batches, ``N`` the hpZ size and ``n`` the data-parallel size, per rank per step:

- memory: the secondary shard holds ``Psi_g / N`` more elements at ``param_bytes`` (``params``);
- forward gathers: ``m Psi_g (n-1)/n`` elements at ``q`` bytes, ``q = 1 + 4/2048`` with qwZ
  (int8 plus one fp32 scale per 2048-element block) else ``param_bytes``;
- backward gathers: with hpZ ``m Psi_g (N-1)/N`` elements at ``param_bytes`` inside the node
  (intra-node bandwidth), else as the forward's;
- the refresh of the persistent ``Psi_p`` stays exact (``param_bytes``).

A collective over a data-parallel group that spans nodes counts as inter-node (the ledger's
convention, ``hybrid.zero.comm``): the group spans nodes when ``n`` exceeds the data-parallel
ranks of a node, ``gpus_per_node / tp``.
"""

from __future__ import annotations

from hybrid.zero.qwz import BLOCK
from hybrid.zero.topology import NodeTopology

QWZ_BYTES = 1 + 4 / BLOCK
"""Bytes per element of a qwZ gather (int8 + its share of the block's fp32 scale)."""


def check(training, cluster, tp: int) -> None:
    """Raise ``ValueError`` when ``training.zero.hpz_partition_size`` does not divide the
    data-parallel ranks of a node (tp must be smaller than the GPUs per node): the run's check,
    :meth:`hybrid.zero.topology.NodeTopology.check_intra_size`, with a node of
    ``cluster.gpus_per_node`` GPUs."""
    n = training.zero.hpz_partition_size
    if n > 1:
        node = NodeTopology(cluster.num_gpus, tp, min(cluster.gpus_per_node, cluster.num_gpus))
        node.check_intra_size(n, node_from="--gpus-per-node")


def gather_terms(training, prec, stage: int, dp: int) -> tuple[tuple[float, int],
                                                               tuple[float, int]]:
    """``((bytes per element, group size) of a forward gather, (same) of a backward one)``."""
    zpp = stage == 3
    q = QWZ_BYTES if zpp and training.zero.quantized_weights else prec.param_bytes
    n = training.zero.hpz_partition_size if zpp else 1
    return (q, dp), ((prec.param_bytes, n) if n > 1 else (q, dp))


def secondary_bytes(psi_t: int, persistent: int, training, prec, stage: int) -> int:
    """Bytes of hpZ's secondary shard on one rank (0 when off or below stage 3)."""
    n = training.zero.hpz_partition_size
    if stage != 3 or n <= 1:
        return 0
    return -(-(psi_t - persistent) // n) * prec.param_bytes


def gather_bytes(psi_t: int, persistent: int, dp: int, micro_batches: int, training, prec,
                 stage: int) -> dict[str, float]:
    """Stage 3's parameter all-gather bytes per step, ``{'forward', 'backward', 'refresh'}``
    (ring factors included; see the module docstring)."""
    (fq, _), (bq, bn) = gather_terms(training, prec, stage, dp)
    g, m = psi_t - persistent, micro_batches
    return {"forward": m * g * fq * (dp - 1) / dp, "backward": m * g * bq * (bn - 1) / bn,
            "refresh": persistent * prec.param_bytes * (dp - 1) / dp}


def inter_node_bytes(dp_bytes: float, psi_t: int, persistent: int, dp: int,
                     micro_batches: int, training, prec, stage: int, cluster, tp: int) -> float:
    """Of ``dp_bytes`` (a step's data-parallel bytes), those that cross nodes: none when the
    data-parallel group fits in one node, else all but hpZ's backward gathers."""
    if dp <= min(cluster.gpus_per_node, cluster.num_gpus) // tp:
        return 0.0
    if stage != 3 or training.zero.hpz_partition_size <= 1:
        return dp_bytes
    return dp_bytes - gather_bytes(psi_t, persistent, dp, micro_batches, training, prec,
                                   stage)["backward"]
