"""The one global gradient-norm routine (every precision, every stage, every grid).

Each rank adds ``||g||^2`` of the gradient elements it *owns* (its ZeRO partition), counting a
TP-replicated parameter on TP rank 0 only (it is identical on every TP rank) and a tied
parameter once (it is one parameter). One all-reduce over the whole world then sums over data
and tensor parallelism at once, so every distinct element of the single-process model is
counted exactly once (otherwise a TP-replicated parameter would count tp times and a tied
one twice).

The same all-reduce carries the overflow flag: a rank that sees a non-finite value in *any*
gradient element it owns (counted or not, so an inf on TP rank 1 is not missed) raises it, and
every rank of the world agrees on skipping the step. The float64 sum of squares is itself the
check (an inf or NaN element makes it non-finite, and fp32 values cannot overflow it), so the
counted elements are read once; the uncounted ones get a float64 sum of squares of their own.
A separate ``max |g|`` pass would cost 4x the sum of squares on CPU (measured: 22 vs 5.3 ms for
7M fp32 elements, one thread).

The flag element also carries the job's stop request (SIGTERM, time limit) in units of
:data:`STOP_UNIT`, so every rank learns it from this all-reduce that the step reads anyway,
instead of a separate all-reduce and host read per iteration. Integer counts below 2**53 are
exact in float64 in any summation order, and the norm element is untouched.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybrid.zero.comm import spans_nodes

STOP_UNIT = float(2**24)
"""A stop request's weight in the flag element (more than any world's count of overflows)."""
NORM_CHUNK_ELEMENTS = 1 << 20
"""Elements converted to float64 at a time for the norm (an 8 MiB temporary)."""


def _sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """float64 ``sum ||g||^2`` over ``tensors`` (a 0-dim tensor on ``device``).

    On CUDA one multi-tensor ``torch._foreach_norm`` launch covers every tensor (a 1.5B model
    has thousands of gradient fragments; one ``vector_norm`` per chunk launched ~5,900 kernels
    per step). On CPU vector_norm(dtype=float64) materialises a float64 copy of its input
    (measured: 2x the fp32 gradient), so a large tensor is summed chunk by chunk, in a fixed
    order (the CPU results stay bit-exact).
    """
    if device.type == "cuda":
        return _foreach_sum_of_squares(tensors, device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in tensors:
        for part in g.reshape(-1).split(NORM_CHUNK_ELEMENTS):
            if part.numel():
                sq += torch.linalg.vector_norm(part, dtype=torch.float64) ** 2
    return sq


def _foreach_sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """``sum ||g||^2`` by one ``torch._foreach_norm`` (float64 results) and one sum: a fixed
    number of launches whatever the number of tensors."""
    tensors = [g for g in tensors if g.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def global_grad_norm(counted: list[torch.Tensor], uncounted: list[torch.Tensor], group=None,
                     ledger=None) -> tuple[float, bool]:
    """L2 norm of the global gradient and whether any rank overflowed
    (:func:`global_grad_norm_and_stop` without a stop request)."""
    return global_grad_norm_and_stop(counted, uncounted, group, ledger)[:2]


def global_grad_norm_and_stop(counted: list[torch.Tensor], uncounted: list[torch.Tensor],
                              group=None, ledger=None,
                              stop: bool = False) -> tuple[float, bool, bool]:
    """L2 norm of the global gradient, whether any rank overflowed and whether any rank asked
    to stop (``stop``), from one all-reduce.

    Args:
        counted: this rank's gradient tensors whose elements it alone counts (see module doc).
        uncounted: the other gradient tensors this rank owns (e.g. TP-replicated ones on TP
            ranks > 0), only checked for inf / NaN.
        group: the group to sum over (default: the world).
        ledger: optional ``DPComm`` whose ledger records the traffic as ``norm_all_reduce``.
        stop: this rank's stop request (see the module docstring).

    Returns:
        ``(norm, overflow, stop_any)``; ``norm`` is ``inf`` when ``overflow``.
    """
    device = (counted or uncounted)[0].device if (counted or uncounted) else torch.device("cpu")
    sq = _sum_of_squares(counted, device)
    bad = (~torch.isfinite(_sum_of_squares(uncounted, device))).double()
    if stop:
        bad = bad + STOP_UNIT
    t = torch.stack([sq, bad])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        if not getattr(ledger, "skip_collectives", False):  # the benchmark's compute-only floor
            dist.all_reduce(t, group=group)
        if ledger is not None:
            n = dist.get_world_size(group)
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            ledger.add("norm_all_reduce", 2 * (n - 1) / n * t.numel() * t.element_size(),
                       spans_nodes(ranks))
    sq_total, flags = host_values(t)
    overflow = flags % STOP_UNIT > 0 or not math.isfinite(sq_total)
    return (float("inf") if overflow else math.sqrt(sq_total)), overflow, flags >= STOP_UNIT


def host_values(t: torch.Tensor) -> list[float]:
    """The values of a small tensor on the host (one synchronisation).

    A fake tensor (``FakeTensorMode``, the dry run of :mod:`hybrid.dryrun.dry_run`) has no
    values; it reads as zeros, which is the normal path everywhere they are used (a finite loss,
    a finite norm, no overflow). Real tensors are read as they are.
    """
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return [0.0] * t.numel()
    return [float(v) for v in t.reshape(-1).tolist()]


def clip_coefficient(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``; 1 when
    ``max_norm`` is 0 (clipping off)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
