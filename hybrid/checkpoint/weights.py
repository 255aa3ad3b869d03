"""Set a model's weights from full tensors by name: the one weight-loading path of
``--finetune`` (a training checkpoint) and ``--init-from-hf`` (a Hugging Face directory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybrid.parallel.tp_spec import get_tp_spec

if TYPE_CHECKING:
    from hybrid.zero.engine import ZeroEngine


def load_weights(engine: ZeroEngine, source: Callable[[str], torch.Tensor]) -> None:
    """Set every parameter of ``engine.model`` (and its fp32 master copy) from ``source``.

    ``source(name)`` returns the full, unpadded tensor of parameter ``name`` (the
    single-process ``GPT`` layout); it is read one parameter at a time, each rank keeps its own
    tensor-parallel shard, and the engine fills one unit at a time
    (:meth:`hybrid.zero.engine.ZeroEngine.load_weights`: the way initial weights enter, no
    full-size staging, no collective). The optimizer starts fresh (zero Adam moments, step 0).
    Works on any grid.

    Raises:
        KeyError: ``source`` has no tensor for a parameter (from ``source``).
        ValueError: the first parameter whose tensor has another shape, with both shapes.
    """
    def local(name: str, param: torch.Tensor) -> torch.Tensor:
        spec = get_tp_spec(param)
        full = source(name)
        if tuple(full.shape) != spec.full_shape:
            raise ValueError(f"{name}: the source tensor has shape {list(full.shape)}, "
                             f"the model's parameter {list(spec.full_shape)}")
        return spec.shard(full.float())

    engine.load_weights(local)
    engine.states.exp_avg.zero_()
    engine.states.exp_avg_sq.zero_()
    for state in engine.optimizer.state.values():
        state["step"].zero_()
    engine.optimizer_steps = 0
