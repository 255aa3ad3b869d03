"""ZeRO data parallelism, stages 0-3 (arXiv 1910.02054 §5): the engine, its partition layout,
gradient reduction, stage-3 parameter gathering, communication ledger, grad norm and loss scaler;
ZeRO++ (arXiv 2306.10209): the node topology, hpZ's secondary shard and qwZ's int8 gathers.

``from hybrid.zero import ZeroEngine, ZeroConfig, OptimizerConfig`` is the public surface."""

from hybrid.zero.config import OptimizerConfig, ZeroConfig
from hybrid.zero.engine import ZeroEngine

__all__ = ["OptimizerConfig", "ZeroConfig", "ZeroEngine"]
