"""The ZeRO engine's AdamW (torch.optim.AdamW, arXiv 1711.05101) over the fragments a rank updates.

The optimizer's parameters are 1-D views of the engine's fp32 ``master`` (the rank's partition
at stages 1-3, every whole parameter at stage 0), grouped by weight-decay rule and by whether
they are the embedding / output weights (Megatron-LM's decoupled learning rate). The Adam
moments are views of the engine's flat ``exp_avg`` / ``exp_avg_sq``, so they are allocated once
and exportable. With ``--optimizer-cpu-offload`` the fragments below the host split step in a
second, host AdamW (:class:`hybrid.zero.offload.SplitAdamW`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from hybrid.zero.config import OptimizerConfig
from hybrid.zero.layout import Fragment, PartitionLayout, is_embedding_or_output
from hybrid.zero.offload import SplitAdamW
from hybrid.zero.storage import FlatStates

KEYS = [(nd, dec) for dec in (False, True) for nd in (False, True)]


def _groups(params: dict, oc: OptimizerConfig) -> list[dict]:
    # wd_mult (Megatron-LM's name): the share of the scheduled weight decay a group gets;
    # decoupled: the embedding and output weights, at --decoupled-lr when it is given
    return [{"params": params[nd, dec], "weight_decay": 0.0 if nd else oc.weight_decay,
             "wd_mult": 0.0 if nd else 1.0, "decoupled": dec}
            for nd, dec in KEYS if params[nd, dec]]


def build_adamw(layout: PartitionLayout, frags, states: FlatStates, oc: OptimizerConfig,
                grad_of: Callable[[Fragment], torch.Tensor] | None, device: torch.device,
                host_split: int = 0, threads: int = 0):
    """AdamW over ``frags`` (layout fragments in the ``master`` domain).

    Args:
        grad_of: ``fragment -> fp32 gradient view`` set as each parameter's ``.grad`` once
            (None: bf16 gradients, whose fp32 copies the engine sets per step).
        device: the training device (CUDA: the device side is torch's fused AdamW).
        host_split: fragments with ``part_offset < host_split`` step on the host (0: none,
            and the result is a plain ``torch.optim.AdamW``).
        threads: torch threads of the host step (0: unchanged).

    Returns:
        ``(optimizer, opt_params)``: the optimizer and ``[(parameter, fragment)]`` in ``frags``
        order.
    """
    sides = {side: {k: [] for k in KEYS} for side in (False, True)}
    opt_params: list[tuple[nn.Parameter, Fragment]] = []
    for f in frags:
        mp = nn.Parameter(states.master[f.part_offset:f.part_offset + f.length])
        mp.grad = grad_of(f) if grad_of is not None else None
        slot = layout.slots[f.slot]
        sides[f.part_offset < host_split][slot.no_decay, is_embedding_or_output(slot.name)].append(
            mp)
        opt_params.append((mp, f))
    # On CUDA torch's fused AdamW: one kernel, and no partition-sized temporaries (the
    # default foreach path allocates sqrt(v) for the whole partition: 1 GB at 100B / 400
    # ranks). On CPU the single-tensor path, whose temporaries are one fragment each. The host
    # side of an offloaded optimizer runs foreach: its temporaries are host memory.
    fused = True if device.type == "cuda" else None
    kw = dict(lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps, fused=fused)
    if host_split:
        opt = SplitAdamW(_groups(sides[False], oc), _groups(sides[True], oc), threads, **kw)
    else:
        opt = torch.optim.AdamW(_groups(sides[False], oc), **kw)
    for mp, f in opt_params:
        host = f.part_offset < host_split
        owner = opt.owner(mp) if host_split else opt
        o = f.part_offset
        owner.state[mp] = {
            "step": torch.tensor(0.0, dtype=torch.float32,
                                 device=device if fused and not host else None),
            "exp_avg": states.exp_avg[o:o + f.length],
            "exp_avg_sq": states.exp_avg_sq[o:o + f.length],
        }
    return opt, opt_params
