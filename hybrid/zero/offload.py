"""ZeRO-Offload of the optimizer (``--optimizer-cpu-offload``; arXiv 2101.06840 §4, Megatron-LM's
hybrid device optimizer): where a rank's fp32 master weights and Adam moments live, the gradient
copies that feed the host step, and the AdamW pair that steps both sides.

The partition domain (``layout.partition_numel`` elements, units in flat order) is split once at
a unit boundary: the first units, until ``--optimizer-offload-fraction`` of the partition is
reached (Megatron-LM's rule: offload while the offloaded count is below the fraction), keep
their master and moments in host memory (pinned when CUDA is available), the rest on the device
(:func:`host_split`, :class:`SplitFlat`). Unit granularity keeps every unit-sized slice that the
engine takes (filling, the parameter refresh, checkpoint fragments, the stage-3 shard) on one
side.

Per optimizer step, on the last micro-batch: as the reduction of a unit's last bucket finishes,
the rank's reduced gradient of that unit (fp32, or bf16 with ``--grad-reduce-in-bf16``) is copied
device->host (:class:`HostGrads`; on CUDA a non-blocking copy on a side stream ordered after the
reduction, on CPU a plain copy). The grad norm, overflow check and clip coefficient are computed
from the device gradients as without offload; then the host waits for its copies, scales its
gradients by the same coefficient and runs torch's CPU AdamW (foreach) on ``--optimizer-cpu-
threads`` threads, while the device part steps as before (:class:`SplitAdamW`). The refresh
(:mod:`hybrid.zero.refresh`) copies the updated host master into the compute-dtype parameters
unit by unit (host->device, then the all-gather; with ``--overlap-param-gather`` the gathers
stay in flight into the next forward). On a CPU-only machine host and device are the same
memory, but the host tensors, copies and the separate host optimizer are the same code path.
"""

from __future__ import annotations

import torch

from hybrid.zero.layout import PartitionLayout


def host_split(layout: PartitionLayout, fraction: float) -> int:
    """Elements of the partition domain kept in host memory: units in flat order are offloaded
    while the offloaded count is below ``fraction * partition_numel`` (0 for ``fraction`` 0;
    the whole partition for 1). The host part is ``[0, split)``."""
    target, split = fraction * layout.partition_numel, 0
    for u in layout.units:
        if split >= target:
            break
        if u.part_offset != split:
            raise AssertionError(f"unit {u.name} starts at {u.part_offset}, expected {split}")
        split += u.shard
    return split


def pin() -> bool:
    """Whether host buffers are pinned (page-locked, for asynchronous copies): with CUDA only."""
    return torch.cuda.is_available()


class SplitFlat:
    """A 1-D fp32 partition-domain buffer split at element ``split``: ``[0, split)`` in host
    memory (``host``), ``[split, numel)`` on the device (``device_part``). Sliced like a tensor
    with ``[a:b]``, as long as the slice lies on one side (the engine slices unit by unit).

    Raises:
        ValueError: a slice crossing the split, or with a step.
    """

    def __init__(self, numel: int, split: int, device: torch.device):
        self.host = torch.zeros(split, dtype=torch.float32, pin_memory=pin())
        self.device_part = torch.zeros(numel - split, dtype=torch.float32, device=device)
        self.split, self._numel = split, numel

    dtype = torch.float32

    def numel(self) -> int:
        return self._numel

    def __getitem__(self, key: slice) -> torch.Tensor:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise ValueError(f"SplitFlat takes [a:b] slices only, got {key!r}")
        a, b, _ = key.indices(self._numel)
        b = max(a, b)
        if b <= self.split:
            return self.host[a:b]
        if a >= self.split:
            return self.device_part[a - self.split:b - self.split]
        raise ValueError(f"slice [{a}:{b}] crosses the host/device split at {self.split}")

    def zero_(self) -> SplitFlat:
        self.host.zero_()
        self.device_part.zero_()
        return self

    def copy_to(self, out: torch.Tensor) -> None:
        """Write the whole buffer into the device tensor ``out`` ``[numel]`` (any dtype)."""
        out[:self.split].copy_(self.host, non_blocking=pin())
        out[self.split:].copy_(self.device_part)

    def parts(self) -> list[torch.Tensor]:
        """The non-empty host and device tensors."""
        return [t for t in (self.host, self.device_part) if t.numel()]

    @property
    def host_bytes(self) -> int:
        return self.host.numel() * 4

    @property
    def device_bytes(self) -> int:
        return self.device_part.numel() * 4


class HostGrads:
    """The host copy ``[split]`` (gradient dtype) of the rank's reduced gradient of the
    offloaded units, filled unit by unit as each unit's reduction finishes.

    Args:
        layout: the partition layout (unit ``u``'s gradient lands at ``[u.part_offset, +shard)``).
        split: host elements (:func:`host_split`).
        grad_dtype: fp32, or bf16 with ``--grad-reduce-in-bf16``.
        owned_grad: ``u -> [u.shard]`` device view of the rank's reduced gradient of unit ``u``.
    """

    def __init__(self, layout: PartitionLayout, split: int, grad_dtype: torch.dtype,
                 owned_grad):
        self.layout, self.split, self.owned_grad = layout, split, owned_grad
        self.buf = torch.zeros(split, dtype=grad_dtype, pin_memory=pin())
        self.stream = None  # created at the first CUDA copy
        self.events: list = []
        self.copies = 0

    def unit_reduced(self, u: int) -> None:
        """Copy unit ``u``'s reduced gradient to the host (nothing for a device-kept unit).
        On CUDA the copy runs on a side stream that first waits for the compute stream (where
        the reduction's result was written), so backward goes on meanwhile."""
        unit = self.layout.units[u]
        if unit.part_offset >= self.split or unit.shard == 0:
            return
        src, dst = self.owned_grad(u), self.buf[unit.part_offset:unit.part_offset + unit.shard]
        self.copies += 1
        if src.device.type == "cuda" and torch.cuda.is_available():
            self.stream = self.stream or torch.cuda.Stream(device=src.device)
            self.stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events.append(event)
        else:
            dst.copy_(src)

    def wait(self) -> None:
        """Block the host until every copy issued since the last wait has landed."""
        for e in self.events:
            e.synchronize()
        self.events.clear()


class SplitAdamW:
    """Two ``torch.optim.AdamW`` over one parameter list: the device one (fused on CUDA) for the
    device-kept fragments, the host one (``foreach=True``, run on ``threads`` torch threads) for
    the offloaded ones. Exposes the optimizer surface the engine and checkpoints use:
    ``param_groups`` (both lists: setting ``lr``/``weight_decay`` on them sets both sides),
    ``state`` (both sides' per-parameter dicts, merged into a new dict on each access: the
    inner dicts are the optimizers' own), ``step()``, and ``owner(param)``.

    Args:
        device_groups / host_groups: param groups (dicts with ``params``) per side (empty
            lists allowed).
        kwargs: AdamW's hyper-parameters (``lr``, ``betas``, ``eps``) and ``fused`` for the
            device side.
        threads: torch threads for the host step (0: leave ``torch.get_num_threads()``).
    """

    def __init__(self, device_groups: list, host_groups: list, threads: int, **kwargs):
        fused = kwargs.pop("fused", None)
        self.device = (torch.optim.AdamW(device_groups, fused=fused, **kwargs)
                       if device_groups else None)
        self.host = (torch.optim.AdamW(host_groups, foreach=True, **kwargs)
                     if host_groups else None)
        self.threads = threads
        self.optimizers = [o for o in (self.device, self.host) if o is not None]
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for o in self.optimizers for p, st in o.state.items()}

    def owner(self, param) -> torch.optim.Optimizer:
        """The optimizer that steps ``param``."""
        host = self.host is not None and any(param is q for g in self.host.param_groups
                                             for q in g["params"])
        return self.host if host else self.device

    def step_device(self) -> None:
        if self.device is not None:
            self.device.step()

    def step_host(self) -> None:
        """The host AdamW step on ``threads`` torch threads (restored afterwards)."""
        if self.host is None:
            return
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            self.host.step()
        finally:
            torch.set_num_threads(before)

    def step(self) -> None:
        self.step_device()
        self.step_host()
