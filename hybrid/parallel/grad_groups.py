"""One all-reduce per block for the TP-summed gradients of replicated parameters.

Under sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2) each replicated
parameter used on a rank's ``s/t`` slice (the norms' weights and biases, the row-parallel
biases, the learned positions) needs its gradient summed over the TP group; so do the per-head
q/k norms at tp > 1 (each rank normalises other heads). Summing each parameter alone costs one
collective per parameter per micro-batch (four to six per GPT block).

A :class:`TPSummedGroup` gathers the parameters of one unit (a transformer block, or the
model's own embeddings and final norm) behind one autograd node: the first module of the unit
to run in a forward passes *all* the unit's parameters through :class:`_SumOverTP`, which
returns them unchanged, and every module takes its own output from it. Autograd runs that
node's backward once every output's gradient is complete, i.e. when the unit's backward is
done, and it sums all of them in one all-reduce of their concatenation before they reach
``param.grad`` (so gradient hooks, the ZeRO engine's included, still see full gradients).

Why per block and not per micro-batch: a single all-reduce per micro-batch has to run after
autograd has accumulated the partial gradients, i.e. on the gradient buffers themselves, before
the data-parallel reduction reads them; that is the ZeRO engine's reduction order to own
(Megatron-LM sums these gradients in its DDP buffers once backward ends), and it would hold back
the overlap of those buckets' data-parallel reduction with the rest of backward.

:func:`tp_summed` is the one-parameter form (one all-reduce of its own), and
:func:`summed_param` what a module calls for each of its TP-summed parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.parallel.ops import TPLedger, all_reduce_tp, copy_to_tp


class _SumOverTP(torch.autograd.Function):
    """The parameters unchanged forward; their gradients summed over the TP group backward, one
    all-reduce per dtype (one in practice) of their concatenation."""

    @staticmethod
    def forward(ctx, group, ledger, *params):
        ctx.group, ctx.ledger = group, ledger
        return params

    @staticmethod
    def backward(ctx, *grads):
        out = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = all_reduce_tp(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group,
                               ctx.ledger, "grad_all_reduce")
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx]), strict=True):
                out[i] = part.view_as(grads[i])
        return None, None, *out


class TPSummedGroup:
    """The replicated parameters of one unit whose gradients are summed together (see the
    module docstring).

    Parameters are named by ``(module, attribute)`` and read when a forward opens the node: a
    ZeRO engine may give the modules new parameter objects after this group is made.

    Args:
        slots: the unit's TP-summed parameters as ``(module, attribute name)``, each once.
        group: the tensor-parallel process group.
        ledger: counts the all-reduce as ``grad_all_reduce`` (same bytes as one per parameter).
    """

    def __init__(self, slots: list[tuple[nn.Module, str]], group, ledger: TPLedger | None):
        self.slots, self.group, self.ledger = list(slots), group, ledger
        self._pending: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, module: nn.Module, name: str) -> torch.Tensor:
        """``module``'s parameter ``name`` as this forward's output of the unit's sum node
        (identity forward).

        The unit's first call in a forward (nothing pending for it) applies the node to every
        parameter of the unit and keeps the others' outputs; each later call of the same
        forward takes its own. A module called again before the unit's first module simply
        opens a new node: every node sums what reaches it, so gradients stay exact whatever
        the order.
        """
        key = (id(module), name)
        out = self._pending.pop(key, None)
        if out is not None:
            return out
        outs = _SumOverTP.apply(self.group, self.ledger,
                                *(getattr(m, n) for m, n in self.slots))
        keys = [(id(m), n) for m, n in self.slots]
        self._pending = dict(zip(keys, outs, strict=True))
        return self._pending.pop(key)


def group_tp_summed_grads(model: nn.Module, group, ledger: TPLedger | None) -> int:
    """Give every module of ``model`` that TP-sums parameter gradients (those with a
    ``tp_summed_params()`` method, the names of those parameters) the :class:`TPSummedGroup`
    of its unit: one per block of ``model.layers``, one for the rest of the model.

    Returns:
        The number of groups made (units with at least one such parameter).
    """
    blocks = list(getattr(model, "layers", []))
    inside = {id(m) for b in blocks for m in b.modules()}
    units = [list(b.modules()) for b in blocks]
    units.append([m for m in model.modules() if id(m) not in inside])
    made = 0
    for modules in units:
        members = [m for m in modules if callable(getattr(m, "tp_summed_params", None))
                   and m.tp_summed_params()]
        if not members:
            continue
        shared = TPSummedGroup([(m, n) for m in members for n in m.tp_summed_params()], group,
                               ledger)
        for m in members:
            m.grad_group = shared
        made += 1
    return made


def tp_summed(param: torch.Tensor, group, ledger: TPLedger | None = None) -> torch.Tensor:
    """``param`` unchanged forward; its gradient all-reduced (summed) over ``group`` backward.

    For a replicated parameter used on this rank's ``s/t`` slice under sequence parallelism:
    each rank's gradient is the slice's part and the sum is the single-process gradient
    (2205.05198 §4.2.2; Megatron-LM all-reduces LayerNorm gradients the same way). Recorded as
    ``grad_all_reduce`` in the ledger.
    """
    return copy_to_tp(param, group, ledger, "grad_all_reduce")


def summed_param(module: nn.Module, name: str) -> torch.Tensor:
    """:func:`tp_summed` of ``module``'s parameter ``name`` (``module`` has ``group``, ``ledger``
    and ``grad_group``), through the module's unit-wide :class:`TPSummedGroup` when it has one
    (one all-reduce per block instead of one per parameter)."""
    if module.grad_group is not None:
        return module.grad_group.take(module, name)
    return tp_summed(getattr(module, name), module.group, module.ledger)
