"""Set a model's weights from full tensors by name: the one weight-loading path of
``--finetune`` (a training checkpoint) and ``--init-from-hf`` (a Hugging Face directory)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid.parallel.layers import get_tp_spec


def load_weights(engine, source: Callable[[str], torch.Tensor]) -> None:
    """Set every parameter of ``engine.model`` (and its fp32 master copy) from ``source``.

    ``source(name)`` returns the full, unpadded tensor of parameter ``name`` (the
    single-process ``GPT`` layout); it is read one parameter at a time and each rank keeps its
    own tensor-parallel shard. The optimizer starts fresh (zero Adam moments, step 0). Works on
    any grid; collective over the data-parallel group (every rank calls).

    Raises:
        KeyError: ``source`` has no tensor for a parameter (from ``source``).
        ValueError: the first parameter whose tensor has another shape, with both shapes.
    """
    state = {}
    for name, p in engine.model.named_parameters():
        spec = get_tp_spec(p)
        full = source(name)
        if tuple(full.shape) != spec.full_shape:
            raise ValueError(f"{name}: the source tensor has shape {list(full.shape)}, "
                             f"the model's parameter {list(spec.full_shape)}")
        master = spec.shard(full.float())
        state[name] = dict(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                           step=torch.tensor(0.0))
    engine.load_optimizer_state_by_name(state)
